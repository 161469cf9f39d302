"""For testing only: what the tests observe inside a run, and the faults they inject. Off by default.

One `Probe` per process. It does nothing unless `--record_ranks` (per-rank records) or the environment variable
`CLS_FAULT=<kind>:<step>:<rank>` asks for it. Faults (FAULTS), on the first attempt of an elastic launch only (a
restarted worker, TORCHELASTIC_RESTART_COUNT > 0, runs clean): SIGKILL that rank after optimizer step N (`step`) or
while saving checkpoint N (`save`); make its save of checkpoint N fail (`savefail`, an OSError); send it SIGTERM or
SIGUSR1 after step N, or with N = 0 at start-up, before the data are prepared (`sigterm`, `sigusr1`); make its
logits NaN in the forward passes of step N (`nan`); after step N, write <output_dir>/probe_waiting and wait there
until a stop signal arrives, 60 s at most (`wait`: a test then signals the launcher at a known step); make
--auto_micro_batch's trial of every micro-batch above N run out of memory on that rank (`oom`, N the largest that
fits: `trial` raises torch.OutOfMemoryError between the trial's forward and backward). It observes the run through
the hook points of recipes/hooks.py (`Probe.installed`): cls.main installs it for the run; inert, it observes
nothing and the batches carry no sample ids.

With --record_ranks each rank writes ranks/rank<i>.json: the ids of the training examples it saw, micro-batch by
micro-batch; per epoch, the micro-batches its loader skipped through `accelerator.skip_first_batches` (a resumed
epoch) and the loader's batch sampler; a float64 sum of each parameter as the rank holds it; rank 0: a
fingerprint (SHA-256 of the bytes) of each weight the run started from, gathered where sharded; the FSDP2 units; the
dtypes the first Linear computed in and the optimizer's master weights and state are kept in; the optimizer that steps
(under Accelerate's and DeepSpeed's wrappers, which may replace the one the recipe built), its update rule and
whether it is torch's fused kernel; the
dtypes FSDP2 accumulates gradients in between the micro-batches of a step; the memory the rank holds
(recipes/model/memstats.py); and, with CLS_COMM=1, "comm": the bytes of the collectives of optimizer steps COMM_STEPS
(recipes/testing/commstats.py), per step and per kind of collective, and the host reads of tensor values in those
steps, by module.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch

from recipes import hooks
from recipes.checkpoints import preemption
from recipes.inputs.data import SAMPLE_IDS
from recipes.model import fsdp_wrap, memstats
from recipes.testing import commstats

FAULT_VARIABLE = "CLS_FAULT"
FAULTS = ("step", "save", "savefail", "sigterm", "sigusr1", "nan", "wait", "oom")
SIGNAL_FAULTS = {"sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1}
# With --record_ranks, CLS_COMM=1 also counts the bytes of the collectives of steps COMM_STEPS (`make bench` sets it;
# tests/test_comm.py too). Off otherwise: the other tests' recorded runs train with no dispatch mode in the step.
COMM_VARIABLE = "CLS_COMM"
# Optimizer steps whose collectives are counted: after step 1 (lazy set-up: FSDP2's and DeepSpeed's first gathers) and
# step 2 (DDP rebuilds its buckets at the second forward, broadcasting their layout), and before the benchmark's
# timed steps (scripts/bench.py warms up 10 steps), since the counter adds Python to every op while it is on.
COMM_STEPS = range(3, 7)


class Probe:
    def __init__(self, record: bool, rank: int, fault: str | None = None, count_comm: bool = False,
                 out: Path | None = None):
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            fault = None  # a restarted worker: the fault happened in the first attempt
        if fault is not None and (fault.split(":")[0] not in FAULTS or fault.count(":") != 2):
            raise ValueError(f"{FAULT_VARIABLE}={fault}: expected <kind>:<step>:<rank>, kind one of {FAULTS}")
        self.record, self.rank, self.fault, self.out = record, rank, fault, out
        self.epochs: list[dict] = []
        self.count_comm = record and count_comm
        self.sample_ids: list[list[int]] = []
        self.forward_dtypes: dict = {}
        self.counter: commstats.CommCounter | None = None  # on from a counted step's first micro-batch to its end
        self.last_step = 0
        self.evaluated = False  # an eval-mode forward ran in the counted step: its gathers are not the step's
        self.comm_steps: dict = {}
        self.model = None  # watched with --record_ranks: FSDP2's pending gradients are read off it
        self.accumulated_grad_dtypes: set = set()
        self.start_weights: dict = {}  # rank 0's, see watch
        self._maybe_signal(0)  # a signal at start-up (fault `sigterm:0:<rank>`, `sigusr1:0:<rank>`)

    @classmethod
    def for_run(cls, cfg, rank: int | None = None) -> "Probe":
        """The probe of a run's process (`rank`: the launcher's RANK unless given)."""
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        return cls(record=cfg.record_ranks, rank=rank, fault=os.environ.get(FAULT_VARIABLE) or None,
                   count_comm=os.environ.get(COMM_VARIABLE) == "1", out=Path(cfg.output_dir))

    @contextlib.contextmanager
    def installed(self):
        """The probe observing the run's points (recipes/hooks.py) while the context lasts; an inert probe (no
        --record_ranks, no fault) observes nothing."""
        points = {"started": self.watch, "epoch": self.epoch, "batch": self.batch, "step": self.step,
                  "trained": self.finish, "saved": self.saved, "trial": self.trial}
        removers = [hooks.observe(point, observer) for point, observer in points.items()] \
            if self.record or self.fault is not None else []
        try:
            yield self
        finally:
            for remove in removers:
                remove()

    @property
    def wants_sample_ids(self) -> bool:
        return self.record

    def watch(self, model, accelerator) -> None:
        """Fingerprint the weights the run starts from, and remember, on the first forward, the dtype the first
        Linear computes in and the dtype of its weight then.

        Under FSDP2 the weight seen in forward is the gathered (bf16) copy, under DeepSpeed the engine's bf16 module,
        under autocast the fp32 parameter with a bf16 output: together they show what precision really ran.
        """
        if self.fault is not None and self.fault.startswith("nan:"):
            model.register_forward_hook(self._poison)
        if not self.record:
            return
        self.model = model
        # gathered where sharded (ZeRO-3, FSDP2): a collective, which every rank of a recorded run reaches here; under
        # ZeRO-3 only the main process gets the state dict (accelerate 1.15.0 returns None on the others)
        state = accelerator.get_state_dict(model) or {}
        self.start_weights = {name: fingerprint(t) for name, t in state.items()} if accelerator.is_main_process else {}
        if torch.cuda.is_available():  # the peaks the record reports are those of training, not of loading
            torch.cuda.reset_peak_memory_stats()
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))

        def hook(module, inputs, output):
            self.forward_dtypes = {"forward_weight": str(module.weight.dtype), "forward_output": str(output.dtype)}
            handle.remove()

        handle = linear.register_forward_hook(hook)
        if self.count_comm:  # on the Linear, not the wrapper: DeepSpeedEngine.eval (0.19.8) sets its module's mode only
            linear.register_forward_pre_hook(self._mark_eval)

    def _poison(self, module, inputs, output):
        if module.training and self.fault == f"nan:{self.last_step + 1}:{self.rank}":
            output.logits.data.fill_(float("nan"))
        return output

    def epoch(self, epoch: int, loader) -> None:
        """The loader the loop iterates in `epoch` (in a resumed epoch, `accelerator.skip_first_batches`' loader)."""
        if self.record:
            sampler = loader.batch_sampler
            self.epochs.append({"epoch": epoch, "batch_sampler": type(sampler).__name__,
                                "skipped_batches": getattr(sampler, "skip_batches", 0)})

    def _mark_eval(self, module, inputs) -> None:
        if self.counter is not None and not module.training:
            self.evaluated = True

    def batch(self, batch) -> None:
        """Take the example ids off a training micro-batch (a plain list beside the tensors) and keep them."""
        if self.record:
            self.sample_ids.append(batch.pop(SAMPLE_IDS))
            if self.model is not None:  # gradients of the step's earlier micro-batches, kept without a sync
                self.accumulated_grad_dtypes |= pending_fsdp_gradient_dtypes(self.model)
            if self.count_comm and self.counter is None and self.last_step + 1 in COMM_STEPS:
                self.counter = commstats.CommCounter()
                self.evaluated = False
                self.counter.__enter__()

    def step(self, step: int) -> None:
        """Called after optimizer step `step` and the evaluation that follows it, before its checkpoint."""
        self.last_step = step
        self._stop_counting(step)
        self._maybe_die("step", step)
        self._maybe_signal(step)
        if self.fault == f"wait:{step}:{self.rank}":
            self._wait_for_signal()

    def _stop_counting(self, step: int) -> None:
        counter, self.counter = self.counter, None
        if counter is None:
            return
        counter.__exit__(None, None, None)
        self.comm_steps[step] = {"sent_bytes": counter.total(), "evaluated": self.evaluated,
                                 "collectives": counter.breakdown(), "unknown_ops": sorted(counter.unknown),
                                 "host_reads": dict(sorted(counter.host_reads.items()))}

    def comm_record(self) -> dict:
        """Bytes sent per rank in each counted step, and their mean over the steps without an evaluation."""
        clean = [s["sent_bytes"] for s in self.comm_steps.values() if not s["evaluated"]]
        return {"steps": {str(k): v for k, v in self.comm_steps.items()},
                "comm_bytes_per_step": sum(clean) / len(clean) if clean else None,
                "convention": "bytes sent per rank: all-reduce 2(n-1)/n S, all-gather / reduce-scatter / broadcast / "
                              "reduce (n-1)/n S, S the whole tensor (recipes/testing/commstats.py)"}

    def trial(self, micro_batch: int) -> None:
        """Called by --auto_micro_batch's trial of `micro_batch` (recipes/training/micro_batch.py), after its
        forward."""
        if self.fault is None or not self.fault.startswith("oom:"):
            return
        _, largest, rank = self.fault.split(":")
        if int(rank) == self.rank and micro_batch > int(largest):
            raise torch.OutOfMemoryError(f"CUDA out of memory: a trial micro-batch of {micro_batch} (injected by "
                                         f"{FAULT_VARIABLE}={self.fault})")

    def saved(self, step: int) -> None:
        """Called by save_checkpoint after this rank wrote its part of checkpoint `step`, before it is committed."""
        self._maybe_die("save", step)
        if self.fault == f"savefail:{step}:{self.rank}":
            raise OSError(28, "No space left on device (injected by CLS_FAULT)")

    def _maybe_signal(self, step: int) -> None:
        kind = self.fault.split(":")[0] if self.fault else None
        if kind in SIGNAL_FAULTS and self.fault == f"{kind}:{step}:{self.rank}":
            os.kill(os.getpid(), SIGNAL_FAULTS[kind])

    def _wait_for_signal(self) -> None:
        (self.out / "probe_waiting").write_text(f"{self.last_step}\n")
        deadline = time.monotonic() + 60
        while preemption.requested_signal is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def _maybe_die(self, where: str, step: int) -> None:
        if self.fault is not None and self.fault == f"{where}:{step}:{self.rank}":
            os.kill(os.getpid(), signal.SIGKILL)

    def finish(self, out: Path, model, optimizer, device: torch.device) -> None:
        """Write this rank's record (see the module docstring)."""
        if not self.record:
            return
        if self.counter is not None:  # a window the loop opened but never closed: no whole step to report
            self.counter.__exit__(None, None, None)
            self.counter = None
        sums = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
        folder = out / "ranks"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"rank": self.rank, "sample_ids": self.sample_ids, "epochs": self.epochs, "param_sums": sums,
                  "start_weights": self.start_weights, "fsdp_units": fsdp_wrap.fsdp_units(model),
                  "dtypes": {**self.forward_dtypes, **probe_dtypes(optimizer)},
                  "optimizer": optimizer_record(optimizer),
                  "accumulated_grad_dtypes": sorted(self.accumulated_grad_dtypes),
                  "memory": memstats.rank_memory(model, optimizer, device), "comm": self.comm_record()}
        (folder / f"rank{self.rank}.json").write_text(json.dumps(record))


def fingerprint(tensor) -> dict:
    """dtype, shape, a SHA-256 of the bytes and the float64 sum of a tensor: equal values give equal fingerprints on
    any machine and thread count (the hash), the sum says by how much two differ."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return {"dtype": str(tensor.dtype), "shape": list(tensor.shape),
            "sha256": hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest(),
            "sum": float(flat.double().sum())}


def probe_dtypes(optimizer) -> dict:
    """dtypes of the optimizer's master weights and state, as the record names them ("torch.float32")."""
    masters, states = memstats.optimizer_dtypes(optimizer)
    return {"master_params": sorted(map(str, masters)), "optimizer_state": sorted(map(str, states))}


def optimizer_record(optimizer) -> dict:
    """The optimizers a step goes through, outermost first (Accelerate's wrapper, DeepSpeed's ZeRO or BF16 optimizer,
    the one that updates), whether the innermost decays weights decoupled from the gradient (AdamW) or adds them to
    it (Adam with L2), and DeepSpeed's per-step overflow check where the chain has one."""
    chain = [optimizer]
    while hasattr(chain[-1], "optimizer"):  # each wrapper keeps the one it wraps as .optimizer (memstats)
        chain.append(chain[-1].optimizer)
    inner = chain[-1]
    decoupled = getattr(inner, "adam_w_mode", None)  # DeepSpeed's CPU Adam
    if decoupled is None:  # torch: AdamW sets the group flag; ZeRO-3 may have emptied param_groups, the class tells
        groups = getattr(inner, "param_groups", [])
        decoupled = groups[0].get("decoupled_weight_decay") if groups else isinstance(inner, torch.optim.AdamW)
    checks = [o.check_grad_overflow for o in chain if hasattr(o, "check_grad_overflow")]
    return {"chain": [type(o).__name__ for o in chain], "decoupled_weight_decay": bool(decoupled),
            "check_grad_overflow": checks[0] if checks else None,
            "fused": bool(getattr(inner, "defaults", {}).get("fused"))}  # torch's fused AdamW (model/kernels.py)


def pending_fsdp_gradient_dtypes(model) -> set:
    """dtypes of the gradients FSDP2 keeps between micro-batches that do not sync (`accelerator.accumulate`).

    Read from torch 2.13.0's FSDP2 internals (`FSDPParam`): with reduce_dtype other than the compute dtype, a
    micro-batch's gradient is upcast into `unsharded_accumulated_grad`; otherwise it stays in the unsharded
    parameter's `.grad`, in the compute dtype. Empty without FSDP2 or outside an accumulation window.
    """
    from torch.distributed.fsdp import FSDPModule

    found = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for param in group.fsdp_params if group is not None else []:
            grad = param.unsharded_accumulated_grad
            if grad is None:
                grad = getattr(getattr(param, "_unsharded_param", None), "grad", None)
            if grad is not None:
                found.add(str(grad.dtype))
    return found
