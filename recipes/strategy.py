"""Every workaround between the recipe and Accelerate / DeepSpeed / torch, in one place.

The recipe never names a strategy: the launch config picks it, and this module makes the same recipe run under it,
on GPUs and, for CI, on CPU processes. Each workaround names the library limit and the version it was read in.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch

from recipes import RecipeError


def make_accelerator(cfg):
    """The Accelerator for a launch config; on a machine without GPUs it rehearses the same strategy on CPU.

    Without an accelerator the processes must talk over gloo, and `cpu=True` is what turns a MULTI_GPU launch into
    MULTI_CPU (accelerate 1.15.0): with `cpu=False` every rank trains alone and nothing fails.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    on_cpu = not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false") == "true"
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # a backend given to a single process makes it wait
    gloo = on_cpu and launched
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout), backend="gloo" if gloo else None)
    accelerator = Accelerator(
        cpu=on_cpu and not deepspeed,  # cpu=True would replace the DeepSpeed launch by plain MULTI_CPU
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the recipe steps the scheduler once per optimizer step itself
        log_with="tensorboard",
        project_dir=cfg.output_dir,
        kwargs_handlers=[group],
    )
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



def grad_norm_after_clip(accelerator, model, value) -> float:
    """The step's gradient norm before clipping, as a float, from what `accelerator.clip_grad_norm_` returned.

    Accelerate 1.15.0 returns None under DeepSpeed (0.19.8 clips inside the engine's step, which has run by the
    time this is called); the engine then holds the pre-clip global norm of the step just taken. FSDP2 returns a
    DTensor, whose full value is the norm over all shards.
    """
    if value is None:
        value = model.get_global_grad_norm()
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)
