"""LoRA through PEFT (--use_peft): which modules get adapters, and how a run's adapted model is saved.

Targets (default): every `nn.Linear` inside the encoder's repeated layers, found from the module tree (recipes/
fsdp_wrap.py's repeated-layer class), so the attention projections and the feed-forward linears of any encoder the
recipe accepts, named by their full module paths. PEFT 0.21.2's own default for BERT/RoBERTa is query/value only, and
its `all-linear` also takes BERT's pooler.dense. The head is no LoRA target: it is trained in full and always saved
(PEFT's modules_to_save): the top model's own modules beside the encoder (`classifier`; DistilBERT's
`pre_classifier`) and the encoder's pooler where it has one (BERT's `pooler`, whose only reader is the classifier).
Everything else is frozen at the pretrained values; the optimizer, weight decay groups and clipping see the trainable
parameters only (cls.param_groups takes `requires_grad` ones).

Saving (final/, best/): `<folder>/adapter/` holds adapter + head as `PeftModel.save_pretrained` writes them, from the
fp32 values gathered from every rank (FSDP2 shards, ZeRO partitions: the optimizer's fp32 master copy, never the
engine's 16-bit one), and `<folder>/` the merged model, built from the fp32 base read from the pretrained files plus
that adapter, which a plain `from_pretrained` and `pipeline()` load.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

from recipes import RecipeError
from recipes.model import decoders, fsdp_wrap

INSTALL = "pip install 'peft==0.21.2' (or pip install '.[lora]')"
# The LoRA flags and their defaults: any other value needs --use_peft.
LORA_DEFAULTS = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.1, "lora_target_modules": None}


def flag_problems(cfg) -> list[str]:
    """The LoRA flags' one-line problems, before any work (flag_checks.flag_problems)."""
    given = [f"--{name}" for name, default in LORA_DEFAULTS.items() if getattr(cfg, name) != default]
    if not cfg.use_peft:
        return [f"{', '.join(given)} without --use_peft: add --use_peft to train LoRA adapters"] if given else []
    problems = []
    try:
        import peft  # noqa: F401
    except ImportError:
        problems.append(f"--use_peft needs the peft package: {INSTALL}")
    if cfg.lora_r < 1:
        problems.append(f"--lora_r {cfg.lora_r} must be >= 1")
    if not 0 <= cfg.lora_dropout < 1:
        problems.append(f"--lora_dropout {cfg.lora_dropout} must be in [0, 1)")
    if cfg.random_init:
        problems.append("--use_peft with --random_init: LoRA adapts pretrained weights, and the frozen base must come "
                        "back from the model's files")
    return problems


def check_targets(cfg, config) -> None:
    """--lora_target_modules names modules of the model: checked on a weightless (meta) copy built from `config`,
    before any process group, as source.check_model_source does for the model's other problems."""
    if not cfg.use_peft or not cfg.lora_target_modules:
        return
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=cfg.trust_remote_code)
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in requested_targets(cfg) if t != "all-linear"
               and not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise RecipeError(f"--lora_target_modules {', '.join(missing)}: no module of {type(model).__name__} is "
                          f"named so (e.g. {', '.join(default_targets(model)[:3])}, or a suffix such as query)")


def requested_targets(cfg) -> list[str]:
    return [t.strip() for t in cfg.lora_target_modules.split(",") if t.strip()]


def default_targets(model) -> list[str]:
    """Full names of the `nn.Linear` modules inside the encoder's repeated layers."""
    layer_class = fsdp_wrap.repeated_layer_class(model)
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and m and
              type(m[0]).__name__ == layer_class]
    inside = {id(sub) for layer_list in layers for sub in layer_list.modules()}
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in inside]


def head_modules(model) -> list[str]:
    """What is trained in full and saved with the adapter: the top model's modules beside the encoder that hold
    parameters, and the encoder's pooler where it has one."""
    encoder = getattr(model, model.base_model_prefix, None)
    head = [name for name, m in model.named_children() if m is not encoder and any(True for _ in m.parameters())]
    pooler = getattr(encoder, "pooler", None)
    if pooler is not None and any(True for _ in pooler.parameters()):
        head.append(f"{model.base_model_prefix}.pooler")
    return head


def apply(cfg, model, pinned: dict | None = None):
    """With --use_peft, the model wrapped as a PEFT LoRA model (base frozen); else the model as it is. `pinned`: the
    base's identity (identity.folder_identity) as the run started, which each merge checks the base against."""
    if not cfg.use_peft:
        return model
    from peft import LoraConfig, get_peft_model
    from transformers.integrations import is_deepspeed_zero3_enabled

    targets = requested_targets(cfg) if cfg.lora_target_modules else default_targets(model)
    if targets == ["all-linear"]:
        targets = "all-linear"
    lora = LoraConfig(task_type="SEQ_CLS", r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, modules_to_save=head_modules(model))
    adapted = get_peft_model(model, lora)
    if is_deepspeed_zero3_enabled():
        # The base was built partitioned in the engine's 16-bit dtype (zero.Init) and DeepSpeed 0.19.8 casts no module
        # it finds so built, while PEFT 0.21.2 makes the adapters in fp32: ZeRO-3's optimizer then fails on partitions
        # of two dtypes (zero/utils.py defragment). The adapters take the base's dtype; the fp32 master copy of them
        # is the optimizer's, as for every ZeRO-1/2 parameter, which the engine casts to 16 bits itself.
        dtype = next(p.dtype for p in adapted.parameters() if not p.requires_grad)
        for param in adapted.parameters():
            if param.requires_grad and param.dtype != dtype:
                param.data = param.data.to(dtype)
    # adapter_config.json's base: the Hub id where there is one, else the folder as an absolute path, so that a copy
    # of adapter/ elsewhere still finds its base.
    source = Path(cfg.model_name_or_path)
    adapted.peft_config["default"].base_model_name_or_path = str(source.resolve()) if source.is_dir() \
        else cfg.model_name_or_path
    adapted.peft_config["default"].revision = None if source.is_dir() else cfg.revision
    # how the merged model reads that base again at save time (source.loading_kwargs, which imports this module):
    # as the run loaded it, and the same files (merge checks them against the pin)
    adapted.base_loading = {"revision": cfg.revision, "cache_dir": cfg.cache_dir,
                            "trust_remote_code": cfg.trust_remote_code,
                            "ignore_mismatched_sizes": cfg.ignore_mismatched_sizes}
    adapted.base_pin = pinned
    return adapted


def is_adapted(model) -> bool:
    """A PEFT model (also after FSDP2's `fully_shard`, which swaps in a class of its own deriving from the model's)."""
    if "peft" not in sys.modules:  # never imported: no model of this run is a PEFT one
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def trained_state(accelerator, model) -> dict[str, torch.Tensor]:
    """The fp32 value of every trainable parameter of the unwrapped PEFT model, whole, on CPU. Every rank calls it
    (collectives): DeepSpeed's fp32 master copy (`safe_get_full_fp32_param`, ZeRO-1/2/3, also offloaded) gathered from
    the partitions; an FSDP2 DTensor gathered from its shards; else the parameter itself (one device, DDP,
    nn.DataParallel, which keep fp32 parameters and compute in autocast)."""
    from accelerate.utils import DistributedType
    from torch.distributed.tensor import DTensor

    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            # After a forward (the evaluation), torch 2.13.0's FSDP2 leaves the root unit's parameters unsharded:
            # plain tensors in the compute dtype (bf16 under mixed precision), not the fp32 shards. Seen in a bf16 run:
            # after rank 0 alone wrote best/, rank 0 held DTensors and rank 1 plain tensors, and final/ hung.
            # Resharded here on every rank (no collective): all read the same fp32 DTensors.
            module.reshard()
    state = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            from deepspeed.utils import safe_get_full_fp32_param

            value = safe_get_full_fp32_param(param)
        elif isinstance(param, DTensor):
            value = param.full_tensor()
        else:
            value = param.detach()
        state[name] = value.float().cpu().clone()
    return state


@contextlib.contextmanager
def zero3_loading_off():
    """transformers 5.23 builds any `from_pretrained` model partitioned (zero.Init, a collective) while Accelerate's
    DeepSpeed ZeRO-3 config is registered; the merged model is built on rank 0 alone, so the registration is lifted
    around it (integrations/deepspeed.py keeps it in a module-level weak reference) and put back."""
    from transformers.integrations import deepspeed as hf_ds

    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def weights_writer(accelerator, model):
    """Gather (every rank) and return the function rank 0 writes a weights folder with: adapter/ and the merged
    model beside it (checkpoint.save_weights)."""
    trained = trained_state(accelerator, model)

    def write(folder: Path) -> None:
        model.save_pretrained(folder / "adapter", state_dict=trained, safe_serialization=True)
        # the classifier's config beside the adapter: its labels, problem type and dtype, which the base's own
        # config.json lacks (docs/lora.md loads the base with it)
        model.get_base_model().config.save_pretrained(folder / "adapter")
        merged = merge(model, folder / "adapter")
        merged.save_pretrained(folder, safe_serialization=True)

    return write


def merge(model, adapter: Path):
    """The base in fp32 from its pretrained files plus the saved fp32 adapter, merged into plain weights."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from recipes.model.identity import check_unchanged

    source = model.peft_config["default"].base_model_name_or_path
    config = model.get_base_model().config
    loading = dict(getattr(model, "base_loading", {}))
    if getattr(model, "base_pin", None):  # the base this run started from, or a one-line error
        loading.update(check_unchanged(source, model.base_pin, "the LoRA base"))
    with zero3_loading_off():
        base = AutoModelForSequenceClassification.from_pretrained(source, config=config, dtype=torch.float32,
                                                                  **loading)
    return PeftModel.from_pretrained(base, adapter).merge_and_unload()


def trainable_count(config, r: int, num_labels: int) -> dict:
    """The trainable parameters of the default LoRA of a BERT/RoBERTa-shaped encoder (counted from its config):
    per layer 4 attention projections (h x h) and the feed-forward pair (h x i, i x h), each with A (r x in) and
    B (out x r); the head in full (RoBERTa's dense + out_proj, or BERT's pooler + classifier)."""
    h, i, n_layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    adapter = n_layers * r * (4 * (h + h) + (h + i) + (i + h))
    head = (h * h + h) + (h * num_labels + num_labels)
    return {"adapter": adapter, "head": head, "total": adapter + head}


def describe(model) -> dict:
    """run_config.json's model entries: "lora", the adapter's settings as PEFT holds them and the parameter counts
    (the base, the adapters, the head's trained copy), without --use_peft none; and a decoder classifier's "decoder"
    (decoders.describe: its pad id)."""
    if not is_adapted(model):
        return decoders.describe(model)
    lora = model.peft_config["default"]
    return {**decoders.describe(model), "lora": {"r": lora.r, "alpha": lora.lora_alpha, "dropout": lora.lora_dropout,
                     "target_modules": sorted(lora.target_modules) if isinstance(lora.target_modules, (set, list))
                     else lora.target_modules, "modules_to_save": sorted(set(lora.modules_to_save or ())),
                     "trainable_params": sum(fsdp_wrap.numel(p) for p in model.parameters() if p.requires_grad),
                     "all_params": sum(fsdp_wrap.numel(p) for p in model.parameters())}}
