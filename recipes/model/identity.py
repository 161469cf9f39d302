"""What a model or tokenizer is, by the hashes of its files rather than where they are: the training contract
compares them on resume (recipes/checkpoints/contract.py), and LoRA's merge checks the base it reads again at each
save against the one the run started from (recipes/model/adapters.py)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from recipes import RecipeError

# Files of a model folder that make it what it is (its Python code and weights too), and of a tokenizer.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spm.model", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")
MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def is_model_file(path: Path) -> bool:
    return path.name in MODEL_FILES or path.suffix in (".py", *WEIGHT_SUFFIXES) or path.name.endswith(".index.json")


def folder_identity(source: str, keep, loading: dict) -> dict:
    """{file name: sha256} of the files of a local folder that `keep` accepts; for a Hub id {"hub": id, "commit":
    the commit its files were resolved at} (transformers records it on the config it loads)."""
    path = Path(source)
    if path.is_dir():
        return {p.name: file_sha256(p) for p in sorted(path.iterdir()) if p.is_file() and keep(p)}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, **loading)
    return {"hub": source, "commit": getattr(config, "_commit_hash", None) or loading.get("revision")}


def check_unchanged(source: str, pinned: dict, what: str) -> dict:
    """The loading arguments that read `source` as it was when `pinned` (its folder_identity) was taken: a Hub model
    at the commit it was resolved at; a folder whose files changed since is a RecipeError naming them."""
    if "hub" in pinned:
        return {"revision": pinned["commit"]} if pinned.get("commit") else {}
    path = Path(source)
    changed = sorted(name for name, digest in pinned.items()
                     if not (path / name).is_file() or file_sha256(path / name) != digest)
    if changed:
        raise RecipeError(f"{what} {source} changed since the run started ({', '.join(changed[:3])}"
                          f"{', ...' if len(changed) > 3 else ''}): it is no longer the model this run trained on")
    return {}
