"""Decoder LLMs as sequence classifiers: Llama, Qwen2/Qwen3, Mistral, Gemma, Phi-3 and any other
`*ForSequenceClassification` of transformers whose head is `score`, a linear layer on the last token's hidden state.

What transformers 5.23 leaves to the user, done here once for every such model:
- The pad id. transformers reads `config.pad_token_id` (never the tokenizer's) and stops at the first batch of more
  than one sequence without it; Llama-family tokenizers have no pad token. The tokenizer gets its eos token as pad
  token when it has none (source.load_tokenizer), and the config gets the tokenizer's pad id (`apply`), so the
  saved final/ batches in `pipeline()` too. run_config.json records the id and where it came from.
- The pooled token. transformers pools the rightmost token that is not the pad id: wrong when the pad id is the eos
  id and a text ends in eos (its last real token is taken for padding), and meaningless for a packed row. Here each
  sequence is classified by its last real token, read from the attention mask (right or left padding alike) or, for
  a packed row (--padding_free), from the sequence boundaries: the model's forward is that of a subclass of its own
  class (same name, so final/'s config.json names the original class), which calls the base model and `score` on
  the pooled hidden states. Position ids count from each sequence's first real token, as `generate` counts them, so
  that a left-padded sequence sees the positions it has alone. No key-value cache is built.
- LoRA, FSDP2 and ZeRO-3 need nothing of their own: `score` is the head PEFT trains in full and saves
  (adapters.head_modules: the top model's modules beside the base model), the decoder layers are the FSDP2 units
  (fsdp_wrap: transformers' `_no_split_modules`) and carry the LoRA targets (their linear layers); a new `score`
  built under ZeRO-3's `zero.Init` is initialised by transformers' loader (tests/test_decoder_strategies.py).

What remains the library's: a final/ reloaded outside the recipe pools as transformers does (the rightmost non-pad
token), which is the last real token unless a text ends in the pad token.
"""
from __future__ import annotations

import functools
import inspect

import torch

from recipes import RecipeError, first_line

HEAD = "score"  # transformers' name for a decoder classifier's head
# tokenizer name -> (pad id, where it came from), set when the run's tokenizer is loaded (give_pad_token)
RESOLVED_PAD: dict = {}
# attention calls on packed rows, counted by --padding_free's attention (padding_free.attention): a decoder checks
# that every layer of a packed forward went there (check_packed_attention)
PACKED_CALLS = [0]


def is_decoder_classifier(model) -> bool:
    """A last-token classifier: its head is transformers' `score` linear layer."""
    return isinstance(getattr(model, HEAD, None), torch.nn.Linear)


_DECODER_CLASSES: dict = {}  # (config class, model type) -> whether its classifier is a decoder classifier


def is_decoder_config(config, trust_remote_code: bool = False) -> bool:
    """Whether the sequence classifier `config` describes is a decoder classifier: built weightless (meta device)
    once per architecture."""
    from transformers import AutoModelForSequenceClassification

    key = (type(config), config.model_type)
    if key not in _DECODER_CLASSES:
        try:
            with torch.device("meta"):
                model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError):  # no sequence-classification class for this config
            return False
        _DECODER_CLASSES[key] = is_decoder_classifier(model)
    return _DECODER_CLASSES[key]


def give_pad_token(tokenizer, name: str) -> None:
    """The tokenizer's pad token: its own, else its eos token (Llama-family tokenizers have no pad token); recorded
    for `apply`. A RecipeError when it has neither: nothing to pad a batch with."""
    if tokenizer.pad_token_id is not None:
        RESOLVED_PAD[name] = (tokenizer.pad_token_id, "the tokenizer's pad token")
        return
    if tokenizer.eos_token_id is None:
        raise RecipeError(f"the tokenizer of '{name}' has neither a pad token nor an eos token to pad batches with: "
                          "give one that has with --tokenizer_name")
    tokenizer.pad_token = tokenizer.eos_token
    RESOLVED_PAD[name] = (tokenizer.pad_token_id, "the tokenizer's eos token (it has no pad token)")


def pad_token(cfg) -> tuple[int, str]:
    """(pad id, where it came from) of the run's tokenizer, loading it when this process has not yet (a model built
    outside the recipe; the recipe's source.load_tokenizer recorded it)."""
    name = cfg.tokenizer_name or cfg.model_name_or_path
    if name not in RESOLVED_PAD:
        from transformers import AutoTokenizer

        # source.loading_kwargs' three flags, read here: source imports this module
        give_pad_token(AutoTokenizer.from_pretrained(name, revision=cfg.revision, cache_dir=cfg.cache_dir,
                                                     trust_remote_code=cfg.trust_remote_code), name)
    return RESOLVED_PAD[name]


def apply(cfg, model):
    """A decoder classifier: the tokenizer's pad id in its config, and the forward that pools each sequence's last
    real token. Any other model as it is."""
    if not is_decoder_classifier(model):
        return model
    pad_id, origin = pad_token(cfg)
    text_config = model.config.get_text_config()
    model.config_pad_token_id = text_config.pad_token_id  # what the model's files said, for run_config.json
    text_config.pad_token_id = pad_id
    model.config.pad_token_id = pad_id
    model.pad_token_origin = origin
    model.__class__ = pooled_class(type(model))
    return model


@functools.lru_cache(maxsize=None)
def pooled_class(cls):
    """`cls` with the last-real-token forward, under the same name (save_pretrained writes it into config.json)."""
    if getattr(cls, "pools_last_real_token", False):
        return cls
    return type(cls.__name__, (cls,), {"forward": pooled_forward, "pools_last_real_token": True,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


@functools.lru_cache(maxsize=None)
def _base_accepts(cls) -> frozenset:
    """The keyword arguments a base model's forward names (and "**" when it takes any)."""
    params = inspect.signature(cls.forward).parameters.values()
    return frozenset(p.name if p.kind != p.VAR_KEYWORD else "**" for p in params)


def last_real_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last position whose mask is 1, whichever side the padding is on."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * (attention_mask != 0)).argmax(-1)


def pooled_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                   cu_seq_lens_q=None, use_cache=None, **kwargs):
    """The base model on the batch, `score` on each sequence's last real token; the model's own loss when `labels`
    are given (the recipe computes its own from the logits)."""
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    base = getattr(self, self.base_model_prefix)
    accepts = _base_accepts(type(base))
    tokens = input_ids if input_ids is not None else inputs_embeds
    if cu_seq_lens_q is not None:  # one packed row: the boundaries tell where each sequence ends
        kwargs["cu_seq_lens_q"] = cu_seq_lens_q
        # --pad_to_multiple_of: the row ends in a filler sequence (padding_free.apply sets packed_tail)
        ends = cu_seq_lens_q[1:-1] if getattr(self, "packed_tail", False) else cu_seq_lens_q[1:]
        rows, last = torch.zeros_like(ends, dtype=torch.long), ends.long() - 1
    elif attention_mask is not None:
        last = last_real_tokens(attention_mask)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        if position_ids is None and "position_ids" in accepts:  # left padding: count from the first real token
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    else:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        last = torch.full_like(rows, tokens.shape[1] - 1)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if "use_cache" in accepts:
        kwargs["use_cache"] = False  # a classifier never decodes: no key-value cache
    calls = PACKED_CALLS[0]
    try:
        out = base(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)
    except ValueError as err:  # transformers 5.23 refuses packed rows for some layers (Qwen3-Next's linear attention)
        if cu_seq_lens_q is None:
            raise
        raise RecipeError(f"--padding_free: {type(self).__name__}: {first_line(err)}; drop --padding_free") from None
    if cu_seq_lens_q is not None and not torch.compiler.is_compiling():
        check_packed_attention(self, PACKED_CALLS[0] - calls)
    hidden = out[0]
    logits = getattr(self, HEAD)(hidden[rows, last.to(hidden.device)])
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
    return SequenceClassifierOutputWithPast(loss=loss, logits=logits, hidden_states=getattr(out, "hidden_states", None),
                                            attentions=getattr(out, "attentions", None))


def check_packed_attention(model, calls: int) -> None:
    """A packed row is exact only if every decoder layer attended through --padding_free's attention, which keeps
    each sequence to itself: a RecipeError naming the model otherwise (a layer with its own attention code, or a
    recurrent layer whose state would run from one sequence into the next)."""
    from recipes.model import fsdp_wrap

    if not hasattr(model, "decoder_layers"):  # counted once: the module tree does not change between forwards
        layer_class = fsdp_wrap.repeated_layer_class(model)
        model.decoder_layers = (layer_class, sum(type(m).__name__ == layer_class for m in model.modules()))
    layer_class, layers = model.decoder_layers
    if calls < layers:
        raise RecipeError(f"--padding_free: {type(model).__name__} ran {calls} of its {layers} {layer_class} layers' "
                          "attention through transformers' attention interface with the sequence boundaries, so "
                          "packed sequences would see each other: drop --padding_free")


def describe(model) -> dict:
    """run_config.json's "decoder" entry: the pad id the run used and where it came from; empty for other models."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(type(base), "pools_last_real_token", False):
        return {}
    return {"decoder": {"pad_token_id": base.config.pad_token_id, "pad_token_from": base.pad_token_origin,
                        "config_pad_token_id": base.config_pad_token_id,
                        "pooling": "last real token (attention mask or packed boundaries)"}}
