"""Where the model and its tokenizer come from: a folder or a Hub id, checked before any work starts (weights that fit
the config, a Hub id this machine can fetch, --max_length within the model's positions), and the loading flags
every `from_pretrained` of a run gets."""
from __future__ import annotations

import contextlib
from pathlib import Path

from recipes import RecipeError, first_line
from recipes.model import adapters, decoders, hub, padding_free

# What a tokenizer is read from (transformers 5.23: tokenizer.json, or the slow tokenizers' vocabulary files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt", "spm.model",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")
# The files that hold a vocabulary; the others (tokenizer_config.json, special_tokens_map.json) only describe one.
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spm.model", "spiece.model", "sentencepiece.bpe.model",
                    "tokenizer.model")
MIN_VOCABULARY = 100  # fewer tokens: an empty tokenizer, not a real one
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


# --torch_dtype: the dtype the model is built in, hence of the master weights and the optimizer state.
DTYPES = ("float32", "bfloat16", "float16", "auto")


def model_dtype(cfg):
    """What `from_pretrained` / `from_config` get as `dtype`. transformers 5.23 builds a model in its file's dtype
    (config.json's `dtype`) when given none, so a bf16 file would train bf16 master weights: fp32 unless asked."""
    import torch

    return "auto" if cfg.torch_dtype == "auto" else getattr(torch, cfg.torch_dtype)


def file_dtype(cfg) -> str | None:
    """The dtype of the floating weights in the model's files (read from the safetensors header, no tensor), else
    its config.json's `dtype`; None when neither says (a Hub model is judged by its config)."""
    path = Path(cfg.model_name_or_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if files:
        from safetensors import safe_open

        found = set()
        with safe_open(str(files[0]), "pt") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if dtype.startswith(("F", "BF")):
                    found.add({"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}.get(dtype,
                                                                                                           dtype))
        if found:
            return ",".join(sorted(found))
    try:
        from transformers import AutoConfig

        dtype = getattr(AutoConfig.from_pretrained(cfg.model_name_or_path, **loading_kwargs(cfg)), "dtype", None)
    except (OSError, ValueError):
        return None
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def loading_kwargs(cfg) -> dict:
    """The loading flags every `from_pretrained` of the run gets (config, model, tokenizer)."""
    return {"revision": cfg.revision, "cache_dir": cfg.cache_dir, "trust_remote_code": cfg.trust_remote_code}


def load_tokenizer(cfg):
    """The tokenizer of --tokenizer_name, else of the model, with a pad token (its eos token where it has none); a
    RecipeError naming it when it cannot be loaded."""
    from transformers import AutoTokenizer

    name = cfg.tokenizer_name or cfg.model_name_or_path
    # transformers 5.23 builds an empty tokenizer (a few special tokens, every text <unk>) from a folder that has a
    # config but no tokenizer files, without a word: refused here, and any tokenizer of such a vocabulary below.
    if Path(name).is_dir() and not any((Path(name) / f).is_file() for f in TOKENIZER_FILES):
        raise RecipeError(f"cannot load the tokenizer of '{name}': the folder has no tokenizer files "
                          f"({', '.join(TOKENIZER_FILES[:3])}, ...); give one with --tokenizer_name")
    if Path(name).is_dir() and not any((Path(name) / f).is_file() for f in VOCABULARY_FILES):
        present = [f for f in TOKENIZER_FILES if (Path(name) / f).is_file()]
        raise RecipeError(f"cannot load the tokenizer of '{name}': the folder has {', '.join(present)} but no "
                          f"vocabulary ({', '.join(VOCABULARY_FILES[:3])}, ...); copy the model's vocabulary file "
                          "into it or give a tokenizer with --tokenizer_name")
    why = hub.unreachable(name, cfg.cache_dir, cfg.revision)  # --tokenizer_name: a Hub id of its own
    if why:
        raise RecipeError(hub.cannot_fetch(name, why))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **loading_kwargs(cfg))
    except (OSError, ValueError, TypeError) as err:
        raise RecipeError(f"cannot load the tokenizer of '{name}': {first_line(err)}") from None
    if len(tokenizer) < MIN_VOCABULARY:
        raise RecipeError(f"cannot load the tokenizer of '{name}': it came out with {len(tokenizer)} tokens, so its "
                          "files are missing or unreadable; give one with --tokenizer_name")
    decoders.give_pad_token(tokenizer, name)  # Llama-family tokenizers have none: their eos token pads
    return tokenizer


@contextlib.contextmanager
def mismatched_sizes_refused(cfg):
    """transformers 5.23 raises a RuntimeError after printing a table when checkpoint weights have another shape than
    the model (a classifier trained with another label count): one line instead, with the flag that allows it."""
    try:
        yield
    except RuntimeError as err:
        if "ignore_mismatched_sizes" not in str(err):
            raise
        raise RecipeError(f"{cfg.model_name_or_path} holds weights of another shape than this run's model (its "
                          "classifier was trained with another label count?): add --ignore_mismatched_sizes to "
                          "start those weights fresh") from None


def check_model_source(cfg):
    """The model's config, loaded once; a RecipeError for a folder without weights (unless --random_init) or with
    weights that do not fit its config, a Hub id that cannot be fetched, or a --max_length beyond the model's
    positions (an error, not a silent clip)."""
    from transformers import AutoConfig

    path = Path(cfg.model_name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RecipeError(f"model folder {path} has no config.json")
        if not cfg.random_init and not any((path / f).is_file() for f in WEIGHT_FILES):
            raise RecipeError(f"model folder {path} holds a config but no weights; add --random_init to train "
                              "this architecture from scratch")
    if not path.exists() and not hub.is_hub_id(cfg.model_name_or_path):
        raise RecipeError(f"model folder {path} not found (nor a Hub id: `name` or `org/name`)")
    why = hub.unreachable(cfg.model_name_or_path, cfg.cache_dir, cfg.revision)  # seconds, not the Hub's retries
    if why:
        raise RecipeError(hub.cannot_fetch(cfg.model_name_or_path, why))
    try:
        config = AutoConfig.from_pretrained(cfg.model_name_or_path, **loading_kwargs(cfg))
    except (OSError, ValueError) as err:
        if path.exists():
            raise RecipeError(f"cannot read model {path}: {first_line(err)}") from None
        why = hub.OFFLINE if hub.offline() else hub.NOT_SERVED
        raise RecipeError(hub.cannot_fetch(cfg.model_name_or_path, why)) from None
    if path.is_dir() and not cfg.random_init:
        check_weights_fit(cfg, config)
    adapters.check_targets(cfg, config)  # --lora_target_modules names modules of this model
    padding_free.check_model(cfg, config)  # --padding_free: an encoder it is exact for
    positions = getattr(config, "max_position_embeddings", None)
    if positions:
        positions -= padding_free.first_position(config)  # RoBERTa's family: the slots before its first position
        if cfg.max_length > positions:
            raise RecipeError(f"--max_length {cfg.max_length} exceeds the {positions} positions of "
                              f"{cfg.model_name_or_path}; use --max_length {positions} or less")
        multiple = cfg.pad_to_multiple_of or 1
        padded = -(-cfg.max_length // multiple) * multiple  # a batch of --max_length tokens, rounded up
        if padded > positions:
            raise RecipeError(f"--pad_to_multiple_of {multiple} pads a batch of --max_length {cfg.max_length} tokens "
                              f"to {padded}, beyond the {positions} positions of {cfg.model_name_or_path}; use "
                              f"--max_length {positions // multiple * multiple} or less")
    return config


def check_weights_fit(cfg, config) -> None:
    """A RecipeError when the folder's weights are not those of the encoder its config.json describes.

    transformers 5.23 loads such a folder with a warning only: a weight the file lacks starts from random init, a file
    tensor the model has no place for is dropped (config.json with 6 layers beside a 2-layer file, or the reverse);
    only a shape mismatch stops it, with a message that blames the classifier. The encoder (the model's
    base_model_prefix) must come from the file whole; the head may be new (a base model's file has none) or of
    another task (roberta-base's lm_head), so its keys are not judged here. transformers' own loader finds the keys,
    renamings included, on the meta device: the header is read, no tensor."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report and progress bar are the real load's, shown once
    hf_logging.disable_progress_bar()
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            cfg.model_name_or_path, config=config, device_map="meta", output_loading_info=True,
            ignore_mismatched_sizes=True, **loading_kwargs(cfg))
    except (OSError, ValueError, RuntimeError) as err:
        raise RecipeError(f"cannot read the weights of {cfg.model_name_or_path}: {first_line(err)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    prefix = model.base_model_prefix
    encoder_parts = {name for name, _ in getattr(model, prefix, model).named_children()}

    def in_encoder(key: str) -> bool:  # a checkpoint key may come with or without the prefix
        key = key[len(prefix) + 1:] if key.startswith(prefix + ".") else key
        return key.split(".", 1)[0] in encoder_parts

    problems = []
    for what, keys in (("lacks {n} of the model's weight{s}", info["missing_keys"]),
                       ("holds {n} tensor{s} of another shape", [k for k, *_ in info["mismatched_keys"]]),
                       ("holds {n} tensor{s} it has no place for", info["unexpected_keys"])):
        keys = sorted(k for k in keys if in_encoder(k))
        if keys:
            problems.append(what.format(n=len(keys), s="s" if len(keys) > 1 else "")
                            + f" ({', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''})")
    if problems:
        raise RecipeError(f"the weights in {cfg.model_name_or_path} do not fit the model its config.json describes "
                          f"({config.model_type}, {getattr(config, 'num_hidden_layers', '?')} layers): the file "
                          + "; it ".join(problems) + "; give the config.json that was saved with these weights")
