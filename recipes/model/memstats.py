"""Memory held by one rank: model-state bytes split into parameters, gradients and optimizer state, and peaks.

Bytes are counted from the tensors the rank really holds, whatever wraps them (DDP, FSDP2 DTensor shards, DeepSpeed
ZeRO partitions and flat buffers): every live tensor is found through the garbage collector and each storage is
counted once, in the first of these groups that reaches it:

- parameters: the model's parameters as this rank stores them (a DTensor's local shard, a ZeRO-3 partition
  `ds_tensor` plus whatever is gathered at that moment);
- gradients: `.grad` of the model's parameters and of the parameters the innermost optimizer updates;
- optimizer_state: the innermost optimizer's state (Adam moments) and its parameters when they are not the model's
  (fp32 master weights of ZeRO / mixed precision);
- other: every other live tensor (DeepSpeed gradient partitions and reduce buckets, buffers, the last batch).

`rank_memory` is called after training and the final evaluation (see probe.Probe.finish), when
`optimizer.zero_grad()` has set the `.grad`s to None: the record is what a rank keeps between optimizer steps, plus
what the evaluation's forward pass left gathered (ZeRO-3 parameters, FSDP2's root unit). scripts/memory_model.py
predicts that as "after_eval". Tensors that live only in C++ (DDP's gradient buckets) are not visible to the garbage
collector; on CUDA, `cuda_allocated_bytes` counts them too.
"""
from __future__ import annotations

import gc
import resource
import sys
import warnings

import torch


def _storage(tensor):
    """((device type, data_ptr), nbytes) of the storage behind `tensor`; None when it has none (meta, empty)."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor wraps the local shard, which owns the storage
    if local is not None:
        tensor = local
    try:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or tensor.device.type == "meta":
            return None
        return (tensor.device.type, storage.data_ptr()), storage.nbytes()
    except Exception:  # tensors half torn down, or subclasses without a storage
        return None


def live_storages() -> dict:
    """{(device type, data_ptr): nbytes} of every distinct tensor storage alive in this process."""
    found = {}
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                is_tensor = torch.is_tensor(obj)
            except Exception:
                continue
            if is_tensor:
                entry = _storage(obj)
                if entry is not None:
                    found[entry[0]] = entry[1]
    return found


def innermost_optimizer(optimizer):
    """The torch optimizer that holds the state, under Accelerate's and DeepSpeed's wrappers (each keeps the one it
    wraps as `.optimizer`; a torch optimizer has no such attribute)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_dtypes(optimizer) -> tuple[set, set]:
    """The dtypes of the parameters the innermost torch optimizer updates (the master weights) and of its state."""
    inner = innermost_optimizer(optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    # DeepSpeed ZeRO-3 (0.19.8) empties param_groups outside its step; its fp32 partitions key the state then.
    params = params or [p for p in inner.state if torch.is_tensor(p)]
    states = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    return {p.dtype for p in params}, {t.dtype for t in states}


def describe_dtypes(optimizer) -> dict:
    """run_config.json's master-weight and optimizer-state dtypes. Before the first step AdamW has no state: it makes
    its moments in the dtype of the parameters it updates (torch 2.13.0 `_init_group`; DeepSpeed 0.19.8's fp32
    partitions alike), which is then reported."""
    masters, states = optimizer_dtypes(optimizer)
    names = lambda dtypes: sorted(str(d).removeprefix("torch.") for d in dtypes)  # noqa: E731
    return {"master_weights": names(masters), "optimizer_state": names(states or masters)}


def _groups(model, optimizer) -> dict:
    """Tensors of each group, in counting order."""
    params = list(model.parameters())
    inner = innermost_optimizer(optimizer)
    state = getattr(inner, "state", {})
    # ZeRO-3 empties param_groups outside its step; the state is still keyed by the fp32 master partitions.
    opt_params = [p for group in getattr(inner, "param_groups", []) for p in group["params"]]
    opt_params += [p for p in state if torch.is_tensor(p)]
    states = [v for s in state.values() if isinstance(s, dict) for v in s.values()]
    # A DTensor the optimizer updates is an FSDP2 shard of the model's own parameter: while a unit is gathered
    # (the root after evaluation) the module holds the unsharded tensor and only the optimizer reaches the shard.
    shards = [p for p in opt_params if hasattr(p, "_local_tensor")]
    return {
        "parameters": params + shards + [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None],
        "gradients": [p.grad for p in params + opt_params if p.grad is not None],
        "optimizer_state": [t for t in states if torch.is_tensor(t)] + opt_params,
    }


def rank_memory(model, optimizer, device: torch.device) -> dict:
    """Bytes this rank holds now, per group (see the module docstring), in all, and at its peaks."""
    gc.collect()
    live = live_storages()
    record, counted = {}, set()
    for name, tensors in _groups(model, optimizer).items():
        total = 0
        for tensor in tensors:
            entry = _storage(tensor)
            if entry is None or entry[0] in counted or entry[0] not in live:
                continue
            counted.add(entry[0])
            total += entry[1]
        record[f"{name}_bytes"] = total
    record["other_bytes"] = sum(n for key, n in live.items() if key not in counted)
    record["live_tensor_bytes"] = sum(live.values())
    by_device = {}
    for (device_type, _), n in live.items():
        by_device[device_type] = by_device.get(device_type, 0) + n
    record["live_tensor_bytes_by_device"] = by_device  # offloaded state sits on "cpu" beside the GPU's
    # The whole process at its peak: interpreter, libraries, activations, model state.
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    record["peak_rss_bytes"] = peak_kib * (1 if sys.platform == "darwin" else 1024)
    if device.type == "cuda":
        record["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        record["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        record["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return record
