"""What an optimizer step needs beside `accelerator.accumulate`: the pre-clip gradient norm without a host read,
and whether an fp16 step was skipped on a loss-scale overflow."""
from __future__ import annotations

import torch


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

class OverflowCheck:
    """Whether the optimizer step just taken was skipped on an fp16 loss-scale overflow, from what really happened.

    Accelerate 1.15.0 (`AcceleratedOptimizer.step`) calls it skipped when the GradScaler did not call the optimizer's
    `step`. torch 2.13.0's GradScaler always calls `step` of an optimizer that does its own inf check
    (`_step_supports_amp_scaling`: the fused AdamW, the recipe's default), passing `found_inf` to the kernel, which
    leaves the weights alone; so Accelerate reported every overflow as a real step: the schedule advanced and the
    non-finite guard stopped the run. With such an optimizer under a GradScaler the answer is read here instead: the
    scale `scaler.update()` (inside `optimizer.step()`) lowers on an overflow, compared with a copy taken before the
    step (a device copy, no host read); reading the comparison is the one host read per optimizer step. The
    scaler's own `found_inf` is gone by then: `update()` clears it. Everywhere else (no scaler: bf16, fp32,
    DeepSpeed's own loss scaler; the non-fused AdamW) Accelerate's answer is right and costs nothing more.
    `_scale` is GradScaler's private tensor in torch 2.13.0; `get_scale()` would read the device twice per step.
    """

    def __init__(self, accelerator, optimizer):
        self.accelerator = accelerator
        scaler = getattr(optimizer, "scaler", None)  # AcceleratedOptimizer keeps the Accelerator's GradScaler
        inner = getattr(optimizer, "optimizer", optimizer)
        self.scaler = scaler if getattr(inner, "_step_supports_amp_scaling", False) else None
        self.scale_before = None

    def before_step(self) -> None:
        """Called on a step's last micro-batch, before `optimizer.step()`."""
        if self.scaler is not None and getattr(self.scaler, "_scale", None) is not None:
            self.scale_before = self.scaler._scale.detach().clone()

    def skipped(self) -> bool:
        """Called after `optimizer.step()` of a step's last micro-batch: True when the step changed no weight."""
        if self.scale_before is None:
            return self.accelerator.optimizer_step_was_skipped
        lowered = bool(self.scaler._scale < self.scale_before)
        self.scale_before = None
        return lowered
