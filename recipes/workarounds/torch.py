"""torch 2.13.0: nn.DataParallel's replicas lose the caller's autocast dtype; a killed op build's lock file makes
every later build wait forever."""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch

from recipes import RecipeError


class AutocastDataParallel(torch.nn.DataParallel):
    """`nn.DataParallel` whose replicas compute in the autocast dtype of the caller, not in fp16.

    Accelerate wraps the prepared model's forward in autocast (bf16 for `mixed_precision=bf16`), which for a
    DataParallel model is DataParallel.forward in the main thread. torch 2.13.0's parallel_apply then runs each replica
    in a thread of its own under `torch.amp.autocast(device_type, enabled=...)`: the flag is passed on, the dtype is
    not, and autocast's dtype is per thread, defaulting to float16 on CUDA. So a bf16 run computed its replicas in
    fp16, without loss scaling. Each replica runs here inside an autocast with the caller's dtype.
    """

    def parallel_apply(self, replicas, inputs, kwargs):
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [functools.partial(run_in_autocast, replica, device_type, dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)

def run_in_autocast(module, device_type: str, dtype: torch.dtype, *args, **kwargs):
    with torch.autocast(device_type, dtype=dtype):
        return module(*args, **kwargs)

STALE_LOCK_SECONDS = 120

def check_extension_locks(root: str | None = None) -> None:
    """Stop with one line when a DeepSpeed op build was killed and left its lock behind.

    torch 2.13.0 (`cpp_extension._jit_compile`, FileBaton) builds an op under `<extensions dir>/<op>/lock` and makes
    every later process wait on that file, without a timeout or a message, until it is deleted. A lock older than
    a build's first minutes that no process holds open is a dead builder's: report it instead of waiting forever.
    """
    from torch.utils.cpp_extension import get_default_build_root

    # Ops live in $TORCH_EXTENSIONS_DIR/<op>/ or, by default, <root>/py311_cpu/<op>/
    # (cpp_extension._get_build_directory).
    base = Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time()
    for lock in [*base.glob("*/lock"), *base.glob("*/*/lock")]:
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > STALE_LOCK_SECONDS and not held_open(lock):
            raise RecipeError(f"a DeepSpeed op build was interrupted and left {lock} behind; every DeepSpeed launch "
                              f"waits on it forever: delete it (rm {lock}) and launch again")

def held_open(path: Path) -> bool:
    """Whether a process of this machine has `path` open (Linux /proc; elsewhere assume it is)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    target = str(path.resolve())
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd) == target:
                    return True
        except OSError:
            continue
    return False
