"""Which module classes FSDP makes units of, for any encoder `AutoModelForSequenceClassification` builds.

accelerate_configs/fsdp.yaml names no class (`fsdp_transformer_layer_cls_to_wrap` unset), so one config fits every
encoder: the recipe picks the classes from the model before `accelerator.prepare` (training/accelerator.py complete_plugins), the
checker (scripts/check_config.py) and the memory model (scripts/memory_model.py) pick the same ones. In order:

1. transformers' `_no_split_modules` (what Accelerate 1.15.0 wraps when no class is named), without the classes that
   hold the input embedding: Accelerate 1.15.0 (`fsdp2_prepare_model`) shards the input embedding as a unit of its
   own after the wrapped classes, and `fully_shard` of a module inside an already sharded one fails in torch 2.13.0
   (`_init_sharding_spec_tp`: "Invariant encountered: value was None"). RoBERTa's {RobertaEmbeddings, RobertaLayer}
   gives RobertaLayer, the class the shipped config named before it fitted every encoder.
2. When that leaves nothing (transformers 5.23 leaves `_no_split_modules` empty for DistilBERT, ELECTRA, DeBERTa,
   ALBERT, MPNet, XLM and others: Accelerate would then wrap nothing and shard the whole model as one unit, so every
   step gathers all of it at once), the class of the encoder's repeated layers: of the `nn.ModuleList`s whose items
   share one class, the one holding the most parameters.
3. Else a RecipeError that names the classes to choose from, for the YAML's `fsdp_transformer_layer_cls_to_wrap`.
"""
from __future__ import annotations

import torch

from recipes import RecipeError

CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def wrap_classes(model) -> tuple[list[str], str]:
    """The class names to wrap and where they came from ("_no_split_modules" or "repeated layers")."""
    present = {type(m).__name__ for m in model.modules()}
    declared = sorted(set(getattr(model, "_no_split_modules", None) or ()) & present - embedding_holders(model))
    if declared:
        return declared, "_no_split_modules"
    layer = repeated_layer_class(model)
    if layer is not None:
        return [layer], "repeated layers"
    raise RecipeError(f"cannot tell which layers of {type(model).__name__} FSDP should shard one at a time: set "
                      "fsdp_transformer_layer_cls_to_wrap in the launch YAML to one of its classes: "
                      + ", ".join(sorted(present - {type(model).__name__})))


def repeated_layer_class(model) -> str | None:
    """The item class of the `nn.ModuleList` of same-class modules holding the most parameters, or None."""
    best, best_size = None, 0
    for module in model.modules():
        items = list(module.children()) if isinstance(module, torch.nn.ModuleList) else []
        if not items or isinstance(items[0], CONTAINERS) or len({type(m) for m in items}) != 1:
            continue
        size = sum(numel(p) for p in module.parameters())
        if size > best_size:
            best, best_size = type(items[0]).__name__, size
    return best


def embedding_holders(model) -> set:
    """Class names of the modules that hold the input embedding (it included); empty when the model does not say
    which module that is."""
    embedding = input_embedding(model)
    if embedding is None:
        return set()
    return {type(m).__name__ for m in model.modules() if any(sub is embedding for sub in m.modules())}


def input_embedding(model):
    """The module Accelerate 1.15.0 shards as the input embedding, or None (also where transformers does not say)."""
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def numel(param) -> int:
    """Elements of a parameter, also when DeepSpeed ZeRO-3 has partitioned it (its local tensor is then empty)."""
    return getattr(param, "ds_numel", None) or param.numel()


def fsdp_units(model) -> list[str]:
    """Class names of the modules FSDP2 made units of (`fully_shard`), the root included, in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
