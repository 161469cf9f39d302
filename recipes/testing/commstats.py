"""For testing only, used by the probe (probe.py beside it) with --record_ranks: the bytes of every collective a
training step issues.

Mechanism: a TorchDispatchMode that sees every op of the c10d library (`torch.ops.c10d.*`, what every
ProcessGroup method dispatches to, also from C++) and of the functional collectives (`torch.ops._c10d_functional.*`,
DTensor's). One mechanism for all strategies, read in torch 2.13.0: DDP's reducer all-reduces its buckets from C++
(`ProcessGroup::allreduce`), and broadcasts the module buffers before each forward (`_broadcast_coalesced`, C++),
both through the dispatcher, so patching Python's `torch.distributed.all_reduce` would see neither; DeepSpeed 0.19.8
(`deepspeed.comm`) and FSDP2 (`_fsdp_collectives`) call `torch.distributed`, which calls ProcessGroup methods, and
DTensor's gradient-norm reduction uses the functional collectives. The collective an op runs inside a handled op is
not seen again (the mode is off while it handles an op), so nothing is counted twice; ops on DTensors are left to
DTensor, and the collectives it issues on its local tensors come back here.

A dispatch mode adds Python to every op while it is on, so the probe turns it on only for a few steps (see
probe.COMM_STEPS), before the benchmark's timed steps.

Convention ("bytes sent per rank", ring and chain algorithms): each collective has a payload S, the bytes of the
whole logical tensor (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor), and a rank of a
group of n sends on average
    all-reduce              2 (n - 1) / n x S    (ring: reduce-scatter, then all-gather)
    all-gather, reduce-scatter, all-to-all    (n - 1) / n x S
    broadcast, reduce       (n - 1) / n x S    (chain: every rank but one forwards S; averaged over the n ranks)
    gather, scatter         (n - 1) / n^2 x S  (only the n - 1 non-root parts of S / n move)
    barrier                 0
The same factors make the textbook predictions (scripts/memory_model.py comm_bytes_per_step), so measured / predicted
compares like with like. Where DeepSpeed ZeRO-1/2 reduces a bucket as n `reduce`s of S / n, one to each partition's
owner ("use_multi_rank_bucket_allreduce": false; by default 0.19.8 all-reduces the whole bucket), a rank sends
(n - 1) / n x S in all, as for one reduce-scatter of S.
"""
from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional")

# op name (without namespace and overload) -> kind of collective; `payload` reads its bytes from the arguments
KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "reduce_": "reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "gather_": "gather", "scatter_": "scatter",
    "barrier": "barrier", "monitored_barrier_": "barrier",
}
# ops that move no data of their own (waits, checks, autograd wrappers), and point-to-point transfers (no strategy
# here uses them)
IGNORED = {"wait_tensor", "check_for_nan", "_wrap_tensor_autograd", "send", "recv_", "recv_any_source_", "isend",
           "irecv", "batch_p2p_ops"}


def ring_factor(kind: str, n: int) -> float:
    """Bytes a rank sends per byte of payload, on average over the n ranks (see the module docstring)."""
    if n <= 1 or kind == "barrier":
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"):
        return (n - 1) / n
    if kind in ("gather", "scatter"):
        return (n - 1) / n**2
    raise ValueError(f"unknown collective kind {kind!r}")


def tensor_bytes(value) -> int:
    """Bytes of the tensors in `value` (a tensor or nested lists of tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def group_size(group) -> int:
    """Ranks in a c10d op's process group (a ProcessGroup script object) or a functional op's group name."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group).size()
    if isinstance(group, torch.ScriptObject):  # what the dispatcher hands over for a ProcessGroup
        from torch.distributed import ProcessGroup

        group = ProcessGroup.unbox(group)
    return group.size()


def payload(name: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(S, n): the payload bytes of one op call by the convention above, and the ranks of its group."""
    if name in ("allgather_", "allgather_coalesced_"):  # output lists: every rank's part
        return tensor_bytes(args[0]), group_size(args[2])
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_"):
        which = 1 if name.startswith("reduce") else 0  # the whole tensors: an all-gather's outputs, a r-s's inputs
        return tensor_bytes(args[which]), group_size(args[2])
    if name in ("reduce_scatter_", "_reduce_scatter_base_"):  # input lists / the whole input
        return tensor_bytes(args[1]), group_size(args[2])
    if name in ("alltoall_", "alltoall_base_"):
        return tensor_bytes(args[1]), group_size(args[2])
    if name in ("gather_",):
        return tensor_bytes(args[1]) * group_size(args[2]), group_size(args[2])
    if name in ("scatter_",):
        return tensor_bytes(args[0]) * group_size(args[2]), group_size(args[2])
    if name in ("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "barrier", "monitored_barrier_"):
        return (0 if "barrier" in name else tensor_bytes(args[0])), group_size(args[1])
    # functional collectives: the group is the last positional argument
    n = group_size(args[-1] if not isinstance(args[-1], int) else args[-2])
    if name.startswith("all_gather"):  # the input is this rank's part
        return tensor_bytes(args[0]) * n, n
    return tensor_bytes(args[0]), n  # all_reduce*, reduce_scatter* (whole input), broadcast, all_to_all_single


class CommCounter(TorchDispatchMode):
    """While active: calls, payload bytes and bytes sent per rank of each kind of collective; and the host reads of
    tensor values (`.item()`, `bool()`: aten._local_scalar_dense), by the module that made them, which on GPUs each
    make the CPU wait for the device (on CPU they cost nothing, but their count is the same)."""

    def __init__(self):
        super().__init__()
        # imported here, not with the module: `import recipes.cls` need not pay for a test instrument that is off
        from torch.distributed.tensor import DTensor

        self.dtensor = DTensor
        self.calls: dict = defaultdict(int)
        self.payload_bytes: dict = defaultdict(int)
        self.sent_bytes: dict = defaultdict(float)
        self.unknown: set = set()
        self.host_reads: dict = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads[reading_module(sys._getframe(1))] += 1
        if any(issubclass(t, self.dtensor) for t in types):
            # DTensor handles the op: it may issue collectives of its own (a Partial norm made Replicate inside
            # clip_grad_norm_), on its local tensors, which then come back to this mode.
            return NotImplemented
        if func.namespace in NAMESPACES:
            self.count(func._opname if hasattr(func, "_opname") else func.__name__.split(".")[0], args, kwargs)
        return func(*args, **kwargs)

    def count(self, name: str, args: tuple, kwargs: dict) -> None:
        if name in IGNORED:
            return
        kind = KINDS.get(name)
        if kind is None:  # a collective this table does not know: shown in the record, never silently dropped
            self.unknown.add(name)
            return
        size, n = payload(name, args, kwargs)
        self.add(kind, size, n)

    def add(self, kind: str, size: int, n: int) -> None:
        self.calls[kind] += 1
        self.payload_bytes[kind] += size
        self.sent_bytes[kind] += size * ring_factor(kind, n)

    def total(self) -> float:
        return sum(self.sent_bytes.values())

    def breakdown(self) -> dict:
        return {kind: {"calls": self.calls[kind], "payload_bytes": self.payload_bytes[kind],
                       "sent_bytes": self.sent_bytes[kind]} for kind in sorted(self.calls)}


# Frames of the dispatch machinery between a host read and the code that asked for it.
DISPATCH_MODULES = ("torch.utils._python_dispatch", "torch._dynamo.eval_frame", "torch._compile", "torch._tensor",
                    __name__)


def reading_module(frame) -> str:
    """The module (package.subpackage) of the code that read a tensor's value, past the dispatch machinery."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(DISPATCH_MODULES):
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "?") if frame is not None else "?"
    return ".".join(name.split(".")[:2])
