"""The optimizer and attention kernels (recipes/model/kernels.py): torch's fused AdamW and SDPA attention, the defaults,
train as torch's per-parameter AdamW and the model's eager attention do, within float tolerance; run_config.json
records which ran; a resumed run keeps the flag's choice; bad values are one RecipeError line.

The shipped configs' runs (tests/test_strategies.py) check that the fused AdamW steps under every strategy.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import TINY, losses, run_recipe
from recipes import RecipeError
from recipes.config import parse_config
from recipes.model import kernels

STEPS = ["--max_train_steps", "8", "--per_device_train_batch_size", "8", "--logging_steps", "1"]
# fp32 on CPU, 8 steps of the tiny model: the fused kernel computes the same update in another order (one pass
# per element instead of a chain of ops), measured max |dloss| 1.2e-7; SDPA's kernel vs eager attention 6e-8. A
# wrong update (another decay, no bias correction) moves the losses by 1e-3 or more from the second step.
LOSS_ATOL = 1e-6


@pytest.fixture(scope="module")
def no_attention_dropout(tmp_path_factory, tiny_model):
    """The tiny model without dropout on the attention probabilities: SDPA draws its dropout mask inside the kernel,
    eager attention from torch's generator, so with it on the two runs would drop other elements (and every later
    dropout mask would move along the random stream)."""
    folder = tmp_path_factory.mktemp("kernels") / "tiny-no-attention-dropout"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config["attention_probs_dropout_prob"] = 0.0
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def runs(no_attention_dropout, tmp_path_factory):
    """One process each: the defaults (fused AdamW, transformers' attention), torch's default AdamW, eager
    attention."""
    base = tmp_path_factory.mktemp("kernel_runs")
    variants = {"default": [], "adamw_torch": ["--optim", "adamw_torch"], "eager": ["--attn_implementation", "eager"]}
    for name, flags in variants.items():
        run_recipe(base / name, *STEPS, "--model_name_or_path", str(no_attention_dropout), *flags, config=None)
    return {name: base / name for name in variants}


def kernels_of(out) -> dict:
    return json.loads((out / "run_config.json").read_text())["kernels"]


def test_fused_adamw_and_sdpa_train_like_the_plain_kernels(runs):
    reference = losses(runs["default"])
    assert len(reference) == 8
    for name in ("adamw_torch", "eager"):
        other = losses(runs[name])
        assert len(other) == 8
        worst = max(abs(a - b) for a, b in zip(reference, other))
        assert worst <= LOSS_ATOL, (name, worst)
    assert kernels_of(runs["default"]) == {"optimizer": "AdamW", "fused": True, "foreach": None,
                                           "attn_implementation": "sdpa", "sdpa_cudnn": None}
    assert kernels_of(runs["adamw_torch"]) == {"optimizer": "AdamW", "fused": False, "foreach": None,
                                               "attn_implementation": "sdpa", "sdpa_cudnn": None}
    assert kernels_of(runs["eager"])["attn_implementation"] == "eager"
    assert kernels_of(runs["eager"])["fused"] is True


def test_a_resumed_optimizer_takes_the_flags_implementation():
    """torch 2.13's load_state_dict keeps the saved groups' `fused`: apply_after_load sets the flag's again, and the
    fused kernel then steps from the loaded state exactly as a fused optimizer that never stopped."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    plain = torch.optim.AdamW([{"params": weights}], lr=0.1)
    for p in weights:
        p.grad = torch.ones_like(p)
    plain.step()
    saved = plain.state_dict()
    resumed = kernels.build_adamw([{"params": weights}], 0.1, "adamw_torch_fused", torch.device("cpu"))
    resumed.load_state_dict(saved)
    assert not resumed.param_groups[0]["fused"]  # what torch restores: the checkpoint's choice
    kernels.apply_after_load(resumed, "adamw_torch_fused", torch.device("cpu"))
    assert resumed.param_groups[0]["fused"] is True
    assert all(s["step"].dtype == torch.float32 and float(s["step"]) == 1 for s in resumed.state.values())
    before = [p.detach().clone() for p in weights]
    resumed.step()  # the fused kernel accepts the loaded state
    assert all(not torch.equal(a, b) for a, b in zip(before, weights))
    assert all(float(s["step"]) == 2 for s in resumed.state.values())


def test_sdpa_leaves_cudnn_out_on_cuda_unless_asked():
    """The GPU default by measurement (kernels.py): on a CUDA device the process-wide switch turns cuDNN's attention off
    for SDPA, --sdpa_cudnn keeps it, and run_config.json records it; a CPU run touches nothing and records None."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        for flags, expected in (([], False), (["--sdpa_cudnn"], True)):
            torch.backends.cuda.enable_cudnn_sdp(not expected)
            cfg = parse_config(["--model_name_or_path", str(TINY), *flags])
            kernels.set_attention_backends(cfg, torch.device("cpu"))
            assert torch.backends.cuda.cudnn_sdp_enabled() is (not expected)  # untouched off CUDA
            assert kernels.describe(model, optimizer, torch.device("cpu"))["sdpa_cudnn"] is None
            kernels.set_attention_backends(cfg, torch.device("cuda", 0))
            assert torch.backends.cuda.cudnn_sdp_enabled() is expected
            assert kernels.describe(model, optimizer, torch.device("cuda", 0))["sdpa_cudnn"] is expected
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)


@pytest.mark.parametrize("flags, message", [
    (["--optim", "sgd"], "unknown --optim 'sgd' (one of adamw_torch_fused, adamw_torch)"),
    (["--attn_implementation", "fast"], "unknown --attn_implementation 'fast' (one of eager, sdpa, "),
    (["--attn_implementation", "eager", "--sdpa_cudnn"], "--sdpa_cudnn chooses a kernel for SDPA attention; "
     "--attn_implementation eager does not run SDPA: drop one of them"),
])
def test_bad_kernel_flags_are_one_line(flags, message):
    with pytest.raises(RecipeError) as caught:
        parse_config(["--model_name_or_path", str(TINY), *flags])
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_an_attention_the_machine_lacks_is_one_line(tiny_model):
    from recipes.cls import build_model

    cfg = parse_config(["--model_name_or_path", str(TINY), "--attn_implementation", "flash_attention_2"])
    cfg.problem_type = "single_label"  # what the data would have inferred
    with pytest.raises(RecipeError) as caught:
        build_model(cfg, ["negative", "positive"])
    assert str(caught.value).startswith("--attn_implementation flash_attention_2: FlashAttention2 has been toggled on")
    assert "\n" not in str(caught.value)
