"""Accelerate 1.15.0: the FSDP state of a CPU launch, FSDP's reduce dtype under mixed precision, and an import of
deepspeed on every unwrap."""
from __future__ import annotations

import sys

import torch


def unwrap_without_importing_deepspeed() -> None:
    """Accelerate 1.15.0's `extract_model_from_parallel` (behind `unwrap_model`, `get_state_dict`, `save_model`)
    imports deepspeed whenever it is installed, to test whether the model is a DeepSpeedEngine: 1.1 s on this
    machine's runs without DeepSpeed, 0.9 s of it mlflow, which deepspeed 0.19.8's autotuner imports when it is
    installed (the trackers extra). No engine exists before deepspeed is imported (a DeepSpeed launch imports it in
    `Accelerator(...)` and `prepare`), so the test asks for deepspeed only once it is there: the same answer for every
    model, without the import. The name is looked up in accelerate.utils.other, where only that function uses it."""
    from accelerate.utils import other

    available = other.is_deepspeed_available
    if not getattr(available, "recipe_checks_import", False):
        def imported_and_available() -> bool:
            return "deepspeed" in sys.modules and available()

        imported_and_available.recipe_checks_import = True
        other.is_deepspeed_available = imported_and_available

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

def reduce_fsdp_gradients_in_fp32(accelerator) -> None:
    """FSDP under bf16/fp16: compute in the low dtype, but reduce and accumulate gradients in fp32.

    Accelerate 1.15.0 (`FullyShardedDataParallelPlugin.set_mixed_precision`) sets reduce_dtype = param_dtype. FSDP2
    (torch 2.13.0, `FSDPParam.to_accumulated_grad_if_needed`) keeps the unsharded gradient across the micro-batches
    of `accelerator.accumulate` (no gradient sync) in that dtype, so accumulation summed bf16 gradients (8 bits of
    mantissa), and the reduce-scatter summed the ranks' gradients in bf16 as well. With reduce_dtype fp32, FSDP2
    upcasts each micro-batch's gradient into an fp32 accumulator and reduce-scatters in fp32: the gradient the
    optimizer sees is what an fp32 sum gives, for twice the bytes of the reduce-scatter (not of the all-gathers).
    The launch config cannot say this (no accelerate launch key for the policy), so it is set here, before prepare.
    """
    import dataclasses

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is None or accelerator.mixed_precision == "no":
        return
    plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)
