"""Memory held by one rank: model-state bytes (parameters, gradients, optimizer state) and peaks.

Model-state bytes are counted from the tensors the rank really holds, whatever wraps them (DDP, FSDP2 DTensor
shards, DeepSpeed ZeRO partitions): every live tensor is found through the garbage collector and each storage is
counted once. Called after the last optimizer step, when activations are freed.
"""
from __future__ import annotations

import gc
import resource
import sys

import torch


def live_tensor_bytes(device_type: str) -> int:
    """Bytes of all distinct tensor storages alive in this process on `device_type`."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not torch.is_tensor(obj) or obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
        except Exception:  # objects half torn down, or tensor subclasses without a storage
            continue
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def rank_memory(model, optimizer, device: torch.device) -> dict:
    gc.collect()
    record = {"live_tensor_bytes": live_tensor_bytes(device.type)}
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    record["peak_rss_bytes"] = peak_kib * (1 if sys.platform == "darwin" else 1024)
    if device.type == "cuda":
        record["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return record
