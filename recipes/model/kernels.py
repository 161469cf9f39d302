"""The fastest correct optimizer and attention kernels for the device, chosen once and recorded in run_config.json.
The figures behind each default are in docs/speed.md ("Kernels") and the results files it links.

Optimizer (--optim, the names of transformers' TrainingArguments.optim):
- `adamw_torch_fused` (default): torch's fused AdamW, one kernel over a group's parameters instead of a few ops per
  parameter; torch 2.13 has it on CPU, CUDA, MPS and XPU (transformers 5.23's Trainer picks it by default for torch
  >= 2.8). The same update rule, rounded differently: per-step losses agree with `adamw_torch` (tests/test_kernels.py).
- `adamw_torch`: torch's default implementation for the device (a per-parameter loop on CPU, foreach on CUDA).
On a device torch has no fused kernel for, `adamw_torch_fused` falls back to `adamw_torch` and says so. DeepSpeed
offload configs replace either by DeepSpeed's CPU Adam; under ZeRO without offload the torch AdamW steps ZeRO's fp32
partitions; under FSDP2 the DTensor shards.

A resumed run keeps the choice of its flags: torch 2.13's Optimizer.load_state_dict takes the saved groups' options,
fused included, so `apply_after_load` sets the flags' value again and moves the step counters where the fused kernel
keeps them (float32 on the parameter's device).

Attention (--attn_implementation): transformers' choice by default (`sdpa` for most encoders in 5.23); `eager` is the
model's own matmul-softmax-matmul. On CUDA, SDPA runs without its cuDNN backend unless --sdpa_cudnn
(torch.backends.cuda.enable_cudnn_sdp, one switch for the whole process): torch 2.11 picks cuDNN's attention for a
padded batch with a mask, which prepares each new sequence length on first use. The choices are recorded.
"""
from __future__ import annotations

import contextlib

import torch

from recipes import RecipeError, first_line

OPTIMIZERS = ("adamw_torch_fused", "adamw_torch")
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def flag_problems(cfg) -> list[str]:
    problems = []
    if cfg.optim not in OPTIMIZERS:
        problems.append(f"unknown --optim '{cfg.optim}' (one of {', '.join(OPTIMIZERS)})")
    if cfg.attn_implementation is not None and cfg.attn_implementation not in ATTENTION:
        problems.append(f"unknown --attn_implementation '{cfg.attn_implementation}' (one of {', '.join(ATTENTION)})")
    elif cfg.sdpa_cudnn and cfg.attn_implementation not in (None, "sdpa"):
        problems.append(f"--sdpa_cudnn chooses a kernel for SDPA attention; --attn_implementation "
                        f"{cfg.attn_implementation} does not run SDPA: drop one of them")
    return problems


def fused_supported(device_type: str) -> bool:
    # torch 2.13 keeps the list in a private helper; the public alternative is to let the first step fail.
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device_type in _get_fused_kernels_supported_devices()


def adamw_options(optim: str, device: torch.device) -> dict:
    """torch.optim.AdamW's implementation arguments for --optim on the device the parameters will train on."""
    if optim == "adamw_torch_fused" and fused_supported(device.type):
        return {"fused": True, "foreach": None}
    return {"fused": None, "foreach": None}  # torch's default for the device


def apply_after_load(optimizer, optim: str, device: torch.device) -> None:
    """After a checkpoint's optimizer state is loaded: the implementation this run asked for, not the saved one."""
    from recipes.model.memstats import innermost_optimizer

    inner = innermost_optimizer(optimizer)
    if not isinstance(inner, torch.optim.AdamW) or not inner.param_groups:
        return  # DeepSpeed's CPU Adam; ZeRO-3 outside its step
    wanted = adamw_options(optim, device)
    for group in inner.param_groups:
        group.update(wanted)
        for param in group["params"]:
            state = inner.state.get(param, {})
            if wanted.get("fused") and torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def build_adamw(groups: list[dict], learning_rate: float, optim: str, device: torch.device) -> torch.optim.AdamW:
    """The recipe's AdamW over `groups` (recipes/cls.py param_groups) with --optim's implementation for `device`."""
    options = adamw_options(optim, device)
    if optim == "adamw_torch_fused" and not options["fused"]:
        print(f"--optim adamw_torch_fused: torch has no fused AdamW for {device.type}; adamw_torch instead")
    return torch.optim.AdamW(groups, lr=learning_rate, **options)


def set_attention_backends(cfg, device: torch.device) -> None:
    """On CUDA: SDPA's cuDNN backend only with --sdpa_cudnn (above). Elsewhere torch has no such backend to choose."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(cfg.sdpa_cudnn)


def model_attention(cfg) -> dict:
    """The keyword that from_pretrained / from_config take for --attn_implementation (none: transformers' choice)."""
    return {} if cfg.attn_implementation is None else {"attn_implementation": cfg.attn_implementation}


def describe(model, optimizer, device: torch.device) -> dict:
    """What run_config.json records: the optimizer that steps and the attention the model runs (on CUDA, whether SDPA
    may use cuDNN's kernel; None elsewhere)."""
    from recipes.model.memstats import innermost_optimizer

    inner = innermost_optimizer(optimizer)
    # the constructor's options: DeepSpeed's CPU Adam (offload) keeps the replaced AdamW's param-group keys unused
    options = getattr(inner, "defaults", {})
    config = getattr(model, "config", None)
    return {"optimizer": type(inner).__name__, "fused": bool(options.get("fused")), "foreach": options.get("foreach"),
            "attn_implementation": getattr(config, "_attn_implementation", None),
            "sdpa_cudnn": torch.backends.cuda.cudnn_sdp_enabled() if device.type == "cuda" else None}


@contextlib.contextmanager
def attention_refused(cfg):
    """transformers 5.23 raises ImportError (flash-attn not installed) or ValueError (an implementation the model
    does not support) from deep inside loading: one line naming the flag instead."""
    try:
        yield
    except (ImportError, ValueError) as err:
        if cfg.attn_implementation is None:
            raise
        raise RecipeError(f"--attn_implementation {cfg.attn_implementation}: {first_line(err)}") from None
