"""transformers 5.23: a model loaded under ZeRO-3 keeps every legacy weight renaming, used or not."""
from __future__ import annotations


def drop_unused_weight_renamings(model):
    """Keep a model loaded under ZeRO-3 from saving some weights under legacy names (LayerNorm.gamma / .beta).

    transformers 5.23 remembers the key renamings a `from_pretrained` applied, so that `save_pretrained` writes the
    names the checkpoint had. Its usual loader keeps only the renamings that matched a key; its DeepSpeed ZeRO-3 loader
    (integrations/deepspeed.py, `model_to_load._weight_conversions = weight_mapping`) keeps them all, the "legacy"
    LayerNorm.gamma -> LayerNorm.weight among them, so final/ of a zero3 run named every LayerNorm.weight
    LayerNorm.gamma: transformers reads it back, other readers of the file do not. Filtered here as the usual loader
    does (`WeightTransform.was_used`). Returns the model.
    """
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions if c.was_used()]
    return model
