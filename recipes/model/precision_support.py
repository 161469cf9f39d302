"""Does the GPU compute in the precision the launch config asks for? bf16 needs compute capability 8.0 (Ampere) or
newer; V100 (7.0) and T4 (7.5) have fp16 only.

Torch 2.13.0 can emulate some bf16 ops on older cards and DeepSpeed 0.19.8 does not check, so a bf16 config there
runs slowly or fails deep inside a kernel; this check stops it at start-up with one line naming the fp16 file to use
instead: the DeepSpeed JSON's fp16 twin (ds_configs/<name>_fp16.json, made by scripts/make_fp16_configs.py), or
`--mixed_precision fp16` on the launch line for the configs without DeepSpeed. Without a GPU there is nothing to
check: the CPU runs bf16 (fp16 on CPU: docs/tutorials.md).
"""
from __future__ import annotations

import json
from pathlib import Path

BF16_MIN_CAPABILITY = (8, 0)


def fp16_twin_name(ds_path: str) -> str:
    path = Path(ds_path)
    return str(path.with_name(f"{path.stem}_fp16.json"))


def ds_enables_bf16(ds_path: str) -> bool:
    try:
        ds = json.loads(Path(ds_path).read_text())
    except (OSError, ValueError):
        return False  # an unreadable JSON is reported by the other checks
    return isinstance(ds, dict) and isinstance(ds.get("bf16"), dict) and ds["bf16"].get("enabled") is True


def gpu_without_bf16() -> str | None:
    """'<name> (compute capability X.Y)' of the first visible GPU when it lacks bf16, else None (also without GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    capability = tuple(torch.cuda.get_device_capability(0))
    if capability >= BF16_MIN_CAPABILITY:
        return None
    return f"{torch.cuda.get_device_name(0)} (compute capability {capability[0]}.{capability[1]})"


def bf16_problems(mixed_precision, ds_path: str | None) -> list[str]:
    """One line if bf16 is asked for (by the DeepSpeed JSON or by mixed_precision) on a GPU without bf16."""
    asks_bf16 = ds_enables_bf16(ds_path) if ds_path else str(mixed_precision) == "bf16"
    gpu = gpu_without_bf16() if asks_bf16 else None
    if gpu is None:
        return []
    fix = f"use {fp16_twin_name(ds_path)} (--deepspeed_config_file)" if ds_path else \
        "use --mixed_precision fp16 on the launch line"
    return [f"bf16 asked for but {gpu} has no bf16 (needs 8.0 or newer): {fix}"]
