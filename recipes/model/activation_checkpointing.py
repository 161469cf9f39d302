"""Activation (gradient) checkpointing: keep only each layer's input in forward, recompute the rest in backward.

Two switches, one per kind of strategy, never both:
- `--gradient_checkpointing` (recipe flag): the model's own `activation_checkpointing_enable` (transformers 5.23.0's
  name; `gradient_checkpointing_enable` is its deprecated alias), for single, DDP and DeepSpeed ZeRO-1/2/3. It wraps
  each encoder layer in torch's non-reentrant checkpoint, which saves and restores the RNG state, so dropout in the
  recomputed forward draws the same masks.
- `fsdp_activation_checkpointing: true` (accelerate_configs/fsdp.yaml): Accelerate 1.15.0 wraps the FSDP units
  itself inside `prepare`; it passes preserve_rng_state=False to torch's checkpoint, so with dropout on the
  recomputed masks differ from the forward's (noticed, not changed here).
Both at once would checkpoint every layer twice (the inner recomputation recomputed again): refused with one line.
"""
from __future__ import annotations

import os

from recipes import RecipeError


def fsdp_checkpointing_requested(env) -> bool:
    """Whether the launch asked FSDP to checkpoint activations (`accelerate launch` sets this from the YAML)."""
    from accelerate.utils import str_to_bool

    return env.get("ACCELERATE_USE_FSDP", "false") == "true" and \
        str_to_bool(env.get("FSDP_ACTIVATION_CHECKPOINTING", "false")) == 1


def apply(model, enabled: bool, env=None) -> None:
    """Turn on the model's gradient checkpointing when asked; a RecipeError if FSDP's is on as well."""
    env = os.environ if env is None else env
    if enabled and fsdp_checkpointing_requested(env):
        raise RecipeError("--gradient_checkpointing and fsdp_activation_checkpointing: true both checkpoint every "
                          "layer; keep one (under FSDP, the config's)")
    if enabled:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
