"""Every workaround between the recipe and Accelerate / DeepSpeed / torch, in one place.

The recipe never names a strategy: the launch config picks it, and this module makes the same recipe run under it,
on GPUs and, for CI, on CPU processes. Each workaround names the library limit and the version it was read in.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from recipes import RecipeError, launch_checks


def make_accelerator(cfg):
    """The Accelerator for a launch config; on a machine without GPUs it rehearses the same strategy on CPU.

    Without an accelerator the processes must talk over gloo, and `cpu=True` is what turns a MULTI_GPU launch into
    MULTI_CPU (accelerate 1.15.0): with `cpu=False` every rank trains alone and nothing fails.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

    launch_checks.check_devices(os.environ)
    on_cpu = not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false") == "true"
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # a backend given to a single process makes it wait
    gloo = on_cpu and launched
    if deepspeed:
        check_extension_locks()
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout), backend="gloo" if gloo else None)
    accelerator = Accelerator(
        cpu=on_cpu and not deepspeed,  # cpu=True would replace the DeepSpeed launch by plain MULTI_CPU
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the recipe steps the scheduler once per optimizer step itself
        log_with="tensorboard",
        project_dir=cfg.output_dir,
        kwargs_handlers=[group],
        # Host-to-device copies that do not wait: the batch comes from pinned memory on GPUs (data.build_loaders).
        dataloader_config=DataLoaderConfiguration(non_blocking=not on_cpu),
    )
    set_matmul_precision(cfg, accelerator)
    set_cpu_threads(accelerator, cfg.cpu_threads)
    if on_cpu and fsdp:
        rehearse_fsdp_on_cpu(accelerator)
    if cfg.data_parallel and accelerator.num_processes > 1:
        raise RecipeError("--data_parallel runs in one process: use `python recipes/cls.py`, not a multi-process launch")
    return accelerator


def rehearse_fsdp_on_cpu(accelerator) -> None:
    """Turn the MULTI_CPU state of a CPU-only FSDP launch into the FSDP state a GPU launch gets.

    Accelerate 1.15.0 sets up FSDP only for accelerator device types (MULTI_GPU, MULTI_XPU, ...), so an FSDP launch
    without GPUs silently becomes plain MULTI_CPU data parallelism, while torch's `fully_shard` itself trains on CPU
    with gloo. Here the state is switched to FSDP with the plugin the launcher's FSDP_* environment describes, so
    `accelerator.prepare` takes the very code path of a GPU run. The distributed type must be set in PartialState's
    shared state too: every new AcceleratorState() copies it from there. Only reached when no GPU is visible.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables set by `accelerate launch`
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def fill_deepspeed_auto(accelerator, cfg) -> None:
    """Fill the DeepSpeed "auto" values that Accelerate cannot fill from the recipe's objects.

    - train_micro_batch_size_per_gpu: Accelerate 1.15.0 reads it from `DataLoader.batch_size`, which is None for a
      loader built on a batch sampler; its error message asks for exactly this assignment.
    - gradient_clipping: Accelerate 1.15.0 fills "auto" with a constant 1.0; the recipe's --max_grad_norm rules.
    Without DeepSpeed there is nothing to fill.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    for key, value in (("train_micro_batch_size_per_gpu", cfg.per_device_train_batch_size),
                       ("gradient_clipping", cfg.max_grad_norm)):
        if plugin.is_auto(key):
            plugin.deepspeed_config[key] = value


def maybe_data_parallel(model, cfg, accelerator):
    """Plain `nn.DataParallel` over the visible GPUs when asked for and more than one is there."""
    if not cfg.data_parallel:
        return model
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        accelerator.print(f"--data_parallel: {n_gpus} GPU(s) visible, falling back to one device ({accelerator.device})")
        return model
    accelerator.print(f"--data_parallel: nn.DataParallel over {n_gpus} GPUs")
    return torch.nn.DataParallel(model)



def set_matmul_precision(cfg, accelerator) -> None:
    """TF32 tensor cores for the fp32 configs on GPUs (single, ddp, multinode, fsdp without bf16).

    torch 2.13.0 leaves fp32 matmuls in full fp32 by default ("highest"); on Ampere and newer, "high" runs them on
    TF32 tensor cores, several times faster, with a 10-bit mantissa in the products and fp32 accumulation: the
    precision fine-tuning with AdamW tolerates (Trainer's --tf32 does the same). The configs stay fp32 rather than
    bf16 so that the fp32 reference runs of the tests mean the same thing on CPU and GPU; --tf32 false turns it off.
    """
    if accelerator.device.type == "cuda" and accelerator.mixed_precision == "no" and cfg.tf32:
        torch.set_float32_matmul_precision("high")


def offloads_optimizer(accelerator) -> bool:
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return False
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    return (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets, Slurm), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_cpu_threads(accelerator, requested: int = 0) -> int:
    """Intra-op threads of a process that computes on CPU (or runs an offloaded optimizer step there); returns them.

    `accelerate launch` 1.15.0 sets OMP_NUM_THREADS=1 in every process unless the config says use_cpu or the user set
    it (commands/launch.py, num_cpu_threads_per_process), so a CPU run would train on one core of the machine, and
    DeepSpeed's CPU Adam (OpenMP) too. The rule: --cpu_threads N if given; else OMP_NUM_THREADS when it is above 1
    (a user's choice: accelerate's own default is 1); else the cores / the processes on this machine. A GPU run that
    keeps its optimizer on the GPU is left alone.
    """
    if accelerator.device.type != "cpu" and not offloads_optimizer(accelerator):
        return torch.get_num_threads()
    if requested > 0:
        threads = requested
    elif int(os.environ.get("OMP_NUM_THREADS", "0") or 0) > 1:
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = max(1, available_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    return threads


def make_optimizer(accelerator, groups: list[dict], lr: float):
    """AdamW, or DeepSpeed's CPU Adam when the DeepSpeed config keeps the optimizer state in CPU memory.

    With offload_optimizer, DeepSpeed 0.19.8 refuses a client torch optimizer (zero_force_ds_cpu_optimizer defaults
    to true) because torch's unfused AdamW on the CPU-held fp32 state is several times slower than its fused,
    vectorised CPU Adam. `adamw_mode=True` makes it the same decoupled-weight-decay AdamW as torch's, with the same
    defaults (betas 0.9/0.999, eps 1e-8), so every strategy trains the same optimizer.
    """
    if offloads_optimizer(accelerator):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=lr)


def clip_gradients(accelerator, model, max_norm: float):
    """Clip to `max_norm` and return the gradient norm before clipping, as a tensor: reading it is left to the
    logger, so the step does not wait for the device.

    Under DeepSpeed the engine has already clipped inside `accelerator.backward` (accelerate 1.15.0 steps the
    engine there), and `accelerator.clip_grad_norm_` would return the norm through `.item()`, a host sync every
    step; the engine's own value is read instead. FSDP2 returns a DTensor: its full value is the global norm.
    """
    engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if engine is not None:
        norm = engine.engine.get_global_grad_norm()
        return torch.as_tensor(norm if norm is not None else float("nan"), dtype=torch.float32)
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().float()


STALE_LOCK_SECONDS = 120


def check_extension_locks(root: str | None = None) -> None:
    """Stop with one line when a DeepSpeed op build was killed and left its lock behind.

    torch 2.13.0 (`cpp_extension._jit_compile`, FileBaton) builds an op under `<extensions dir>/<op>/lock` and makes
    every later process wait on that file, without a timeout or a message, until it is deleted. A lock older than
    a build's first minutes that no process holds open is a dead builder's: report it instead of waiting forever.
    """
    from torch.utils.cpp_extension import get_default_build_root

    # Ops live in $TORCH_EXTENSIONS_DIR/<op>/ or, by default, <root>/py311_cpu/<op>/ (cpp_extension._get_build_directory).
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
