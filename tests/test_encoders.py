"""Encoders that are not RoBERTa, and what every config must hold for any of them.

- The FSDP wrap classes come from the model (recipes/model/fsdp_wrap.py) for every encoder family, and a DistilBERT
  (`_no_split_modules` empty in transformers 5.23) gets one FSDP unit per layer under the shipped fsdp.yaml.
- fp32 parity with DDP and exact resume: DistilBERT under FSDP2, DeBERTa-v2 under ZeRO-3 (partitioned loading),
  both built offline (random init, a WordPiece tokenizer trained on the data; the DeBERTa folder has no tokenizer and
  takes DistilBERT's through --tokenizer_name). The weights each run starts from equal the folder's files.
- Clipping: one clipped AdamW step, recovered from the update, has exactly the gradient norm --max_grad_norm, on
  DDP, FSDP2, ZeRO-2 and ZeRO-3; the same step unclipped moves the weights 1000x further.
- Weight decay on matrices only, whatever the parameters are named; loading flags.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, fp32_launch_args, losses, rank_records, read_jsonl, run_recipe
from recipes import RecipeError, cls
from recipes.model import fsdp_wrap
from recipes.testing.probe import fingerprint
from scripts import memory_model

# 4 optimizer steps of 2 x 8 samples, a checkpoint at step 2 to resume from.
RUN = ["--max_train_samples", "128", "--max_eval_samples", "32", "--per_device_train_batch_size", "8",
       "--max_train_steps", "4", "--checkpointing_steps", "2", "--record_ranks"]
# FSDP2 and ZeRO-3 against DDP in fp32: float32 sums in another order, as in test_strategies (PARITY_ATOL).
PARITY_ATOL = 5e-7
# Architectures for the model-only checks: every family transformers 5.23 builds a sequence classifier for that
# the README names, with and without `_no_split_modules`, shared layers (ALBERT), nested layer lists (Funnel), norms
# not called LayerNorm (ModernBERT's `norm`, XLM's `layer_norm_emb`).
ARCHS = ["bert", "roberta", "xlm-roberta", "distilbert", "electra", "deberta", "deberta-v2", "albert", "mpnet",
         "modernbert", "funnel", "xlm", "big_bird", "convbert", "roformer", "megatron-bert", "rembert", "longformer"]


def meta_model(arch: str):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(AutoConfig.for_model(arch, num_labels=2))


@pytest.mark.parametrize("arch", ARCHS)
def test_wrap_classes_and_decay_groups_fit_any_encoder(arch):
    model = meta_model(arch)
    names, source = fsdp_wrap.wrap_classes(model)
    wrapped = [m for m in model.modules() if type(m).__name__ in names]
    embedding = model.get_input_embeddings()
    assert wrapped and not any(embedding is sub for m in wrapped for sub in m.modules()), (names, source)
    assert source == ("_no_split_modules" if model._no_split_modules else "repeated layers")
    if source == "repeated layers" and arch not in ("albert", "funnel", "xlm"):  # one module per encoder layer
        assert len(wrapped) == model.config.num_hidden_layers, names
    decay, no_decay = cls.param_groups(model, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    trained = [p for p in model.parameters() if p.requires_grad]  # RoFormer's sinusoidal positions are frozen
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in trained if p.dim() == 1}
    assert {id(p) for p in decay["params"]} == {id(p) for p in trained if p.dim() >= 2}


def test_wrap_class_unknown_names_the_classes_to_choose():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    with pytest.raises(RecipeError, match="set fsdp_transformer_layer_cls_to_wrap .*: Embedding, Linear"):
        fsdp_wrap.wrap_classes(model)


def test_decay_groups_of_a_zero3_partitioned_model():
    """Built under DeepSpeed's zero.Init every local tensor is empty and 1-D; the full shape is in ds_shape."""
    model = meta_model("distilbert")
    for p in model.parameters():
        p.ds_shape = tuple(p.shape)
        p.data = torch.empty(0, device="meta")
    decay, no_decay = cls.param_groups(model, 0.01)
    assert len(decay["params"]) == sum(len(p.ds_shape) >= 2 for p in model.parameters()) > 0
    assert len(no_decay["params"]) == sum(len(p.ds_shape) == 1 for p in model.parameters()) > 0


def model_flags(arch, encoders):
    flags = ["--model_name_or_path", str(encoders[arch])]
    return flags + (["--tokenizer_name", str(encoders["distilbert"])] if arch == "deberta-v2" else [])


def assert_starts_from_files(out, folder, dtype=torch.float32):
    """The weights the run started from (rank 0's record, gathered where sharded) are the folder's, to the dtype
    the strategy computes in. Compared key by key: a missing or renamed weight fails too."""
    start = rank_records(out)[0]["start_weights"]
    files = load_file(folder / "model.safetensors")
    for key, tensor in files.items():
        prefixed = key if key in start else next(k for k in start if k.endswith("." + key))
        got, want = start[prefixed], fingerprint(tensor.to(dtype))
        assert got["sha256"] == want["sha256"], (key, got, want)
    return start


@pytest.mark.parametrize("arch,config", [("distilbert", "fsdp.yaml"), ("deberta-v2", "zero3.yaml")])
def test_parity_and_resume_on_other_architectures(encoders, tmp_path, arch, config):
    flags = [*model_flags(arch, encoders), *RUN]
    ref, got, resumed = tmp_path / "ddp", tmp_path / config[:-5], tmp_path / "resumed"
    run_recipe(ref, *flags)
    launch = fp32_launch_args(config, tmp_path)
    proc = run_recipe(got, *flags, config=config, launch_args=launch)
    delta = max(abs(a - b) for a, b in zip(losses(ref), losses(got)))
    print(f"{arch} {config}: max |loss - ddp loss| over 4 steps = {delta:.3e}")
    assert len(losses(got)) == len(losses(ref)) == 4 and delta <= PARITY_ATOL
    assert read_jsonl(got / "eval.jsonl")[-1]["n_examples"] == 32
    for out in (ref, got):
        assert_starts_from_files(out, encoders[arch])
        assert set(load_file(out / "final" / "model.safetensors")) == set(load_file(encoders[arch] /
                                                                                   "model.safetensors"))
    resolved = json.loads((got / "run_config.json").read_text())["config"]
    assert resolved["tokenizer_name"] == (str(encoders["distilbert"]) if arch == "deberta-v2" else None)
    if config == "fsdp.yaml":  # one unit per layer (transformers leaves DistilBERT's _no_split_modules empty)
        assert "FSDP shards TransformerBlock one at a time (repeated layers" in proc.stdout
        assert [u for u in rank_records(got)[0]["fsdp_units"] if "TransformerBlock" in u] == [
            "FSDPTransformerBlock"] * 2
    resumed.mkdir()
    for name in ("metrics.jsonl", "eval.jsonl"):
        shutil.copy(got / name, resumed)
    run_recipe(resumed, *flags, "--resume_from_checkpoint", str(got / "checkpoints" / "step_2"), config=config,
               launch_args=launch)
    assert losses(resumed) == losses(got)
    assert read_jsonl(resumed / "eval.jsonl")[-1] == read_jsonl(got / "eval.jsonl")[-1]


# One AdamW step from the files, weight decay 0: p1 - p0 = -lr * g / (|g| + eps) elementwise (step 1, bias
# corrections included), g the clipped gradient. So |g| = eps * |d| / (lr - |d|) for d = p1 - p0, and the norm of
# the recovered g is the clipping norm when the step clipped. The norm is chosen so that |g| < eps everywhere: then
# |d| < lr / 2 and the inversion is well conditioned; unclipped, |d| is about lr for every weight with a gradient.
CLIP, LR, EPS = 1e-11, 1.0, 1e-8
ONE_STEP = ["--max_train_samples", "64", "--max_eval_samples", "16", "--per_device_train_batch_size", "8",
            "--max_train_steps", "1", "--learning_rate", str(LR), "--weight_decay", "0"]


def recovered_gradient_norm(start: dict, final: dict) -> tuple[float, float]:
    """(norm of the gradient the step applied, norm of the update), in float64."""
    grad_sq = update_sq = 0.0
    for key, p0 in start.items():
        d = (final[key].double() - p0.double()).abs()
        update_sq += float((d * d).sum())
        g = EPS * d / (LR - d).clamp_min(1e-30)
        grad_sq += float((g * g).sum())
    return math.sqrt(grad_sq), math.sqrt(update_sq)


@pytest.mark.parametrize("config", ["ddp.yaml", "fsdp.yaml", "zero2.yaml", "zero3.yaml"])
def test_one_clipped_step_matches_the_hand_computation(encoders, tmp_path, config):
    folder = encoders["distilbert"]
    start = load_file(folder / "model.safetensors")
    out = tmp_path / "clipped"
    run_recipe(out, "--model_name_or_path", str(folder), *ONE_STEP, "--max_grad_norm", str(CLIP), config=config,
               launch_args=fp32_launch_args(config, tmp_path))
    pre_clip = read_jsonl(out / "metrics.jsonl")[0]["grad_norm"]
    grad, update = recovered_gradient_norm(start, load_file(out / "final" / "model.safetensors"))
    print(f"{config}: gradient norm {pre_clip:.4g} before clipping, {grad:.6g} applied (max_grad_norm {CLIP})")
    assert pre_clip > 1e6 * CLIP
    assert grad == pytest.approx(CLIP, rel=1e-4)  # torch and DeepSpeed scale by max_norm / (norm + 1e-6)
    assert update == pytest.approx(LR * CLIP / EPS, rel=1e-2)
    if config == "ddp.yaml":  # the same step unclipped: each weight with a gradient moves by about lr
        unclipped = tmp_path / "unclipped"  # one process takes both ranks' 2 x 8 samples: the same step
        run_recipe(unclipped, "--model_name_or_path", str(folder), *ONE_STEP, "--max_grad_norm", "1e9",
                   "--per_device_train_batch_size", "16", config=None)
        _, free_update = recovered_gradient_norm(start, load_file(unclipped / "final" / "model.safetensors"))
        assert free_update > 1000 * update


def test_build_offline_model_puts_another_architecture_in_its_own_folder(tmp_path, monkeypatch, capsys):
    """`scripts/build_offline_model.py --arch bert` without --output_dir writes artifacts/tiny-bert, a BERT classifier
    that loads, and leaves artifacts/tiny-roberta (make demo's and the tests' model) alone; without --arch the default
    stays artifacts/tiny-roberta, and --output_dir still names the folder."""
    from transformers import AutoConfig

    from scripts import build_offline_model

    assert build_offline_model.parse_args([]).output_dir == "artifacts/tiny-roberta"
    assert build_offline_model.parse_args(["--arch", "mpnet"]).output_dir == "artifacts/tiny-mpnet"
    assert build_offline_model.parse_args(["--arch", "bert", "--output_dir", "m/b"]).output_dir == "m/b"
    monkeypatch.chdir(tmp_path)  # the default folder is relative to the current directory, as in the Makefile
    (tmp_path / "artifacts" / "tiny-roberta").mkdir(parents=True)
    (tmp_path / "artifacts" / "tiny-roberta" / "config.json").write_text("{}")
    build_offline_model.main(["--arch", "bert"])
    assert json.loads((tmp_path / "artifacts" / "tiny-roberta" / "config.json").read_text()) == {}
    assert AutoConfig.from_pretrained(tmp_path / "artifacts" / "tiny-bert").model_type == "bert"
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == ["tiny-bert", "tiny-roberta"]
    assert "\nartifacts/tiny-bert: tiny bert sequence classifier" in "\n" + capsys.readouterr().out


def test_memory_model_accepts_other_encoders(encoders):
    shape = memory_model.shape_from_model(str(encoders["distilbert"]))
    layers = sum(p.numel() for n, p in load_file(encoders["distilbert"] / "model.safetensors").items()
                 if ".transformer.layer." in n)
    embedding = sum(p.numel() for n, p in load_file(encoders["distilbert"] / "model.safetensors").items()
                    if n.endswith("word_embeddings.weight"))
    assert shape.fsdp_root_params == shape.num_params - layers - embedding and shape.num_layers == 2


def test_mismatched_classifier_needs_the_flag(encoders, tmp_path):
    """A classifier saved with 3 labels, fine-tuned on 2: one line naming --ignore_mismatched_sizes, then the flag
    starts the classifier fresh and keeps the encoder."""
    from transformers import AutoModelForSequenceClassification

    three = tmp_path / "three_labels"
    model = AutoModelForSequenceClassification.from_pretrained(encoders["distilbert"], num_labels=3,
                                                               ignore_mismatched_sizes=True)
    model.save_pretrained(three)
    for f in encoders["distilbert"].glob("tokenizer*"):
        shutil.copy(f, three)
    flags = ["--model_name_or_path", str(three), *ONE_STEP, "--learning_rate", "1e-30"]
    proc = run_recipe(tmp_path / "refused", *flags, config=None, check=False)
    assert proc.returncode == 2 and not (tmp_path / "refused" / "final").exists()
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {three} holds weights of another shape than this run's model (its classifier was trained with "
        "another label count?): add --ignore_mismatched_sizes to start those weights fresh"]
    run_recipe(tmp_path / "ok", *flags, "--ignore_mismatched_sizes", config=None)
    final = load_file(tmp_path / "ok" / "final" / "model.safetensors")
    saved = load_file(three / "model.safetensors")
    assert final["classifier.weight"].shape == (2, 64) and saved["classifier.weight"].shape == (3, 64)
    assert torch.equal(final["distilbert.embeddings.word_embeddings.weight"],
                       saved["distilbert.embeddings.word_embeddings.weight"])  # learning rate 1e-30: no fp32 change
    assert json.loads((tmp_path / "ok" / "run_config.json").read_text())["config"]["ignore_mismatched_sizes"] is True


def test_missing_tokenizer_is_one_line(encoders, tmp_path):
    proc = run_recipe(tmp_path / "run", *model_flags("deberta-v2", encoders)[:2], *ONE_STEP, config=None, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"error: cannot load the tokenizer of '{encoders['deberta-v2']}'")
    assert not (tmp_path / "run").exists()


def test_unused_parameters_under_ddp(encoders, tmp_path):
    """A DeBERTa-v2 config with relative attention but no pos_att_type never uses its relative embeddings: DDP fails
    at the second step; the recipe says so in one line, and --ddp_find_unused_parameters trains it."""
    folder = tmp_path / "unused"
    shutil.copytree(encoders["deberta-v2"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pos_att_type": None}))
    flags = ["--model_name_or_path", str(folder), "--tokenizer_name", str(encoders["distilbert"]), *ONE_STEP,
             "--max_train_steps", "2", "--learning_rate", "1e-3"]
    proc = run_recipe(tmp_path / "refused", *flags, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [
        "error: some parameters of the model got no gradient in a step, which DDP refuses: add "
        "--ddp_find_unused_parameters (or remove the unused layers from the model's config)"], proc.stderr[-3000:]
    run_recipe(tmp_path / "ok", *flags, "--ddp_find_unused_parameters")
    assert len(losses(tmp_path / "ok")) == 2


def test_checker_names_the_wrap_class_to_copy(encoders, capsys, monkeypatch):
    from scripts import check_config

    monkeypatch.chdir(REPO)
    assert check_config.main(["accelerate_configs/fsdp.yaml", "--model_name_or_path", str(encoders["distilbert"])]) == 0
    ok, note, memory = capsys.readouterr().out.splitlines()
    assert memory.startswith("accelerate_configs/fsdp.yaml: note: per GPU (fsdp, 2 processes, bf16): model state ")
    assert ok.startswith(f"ok: accelerate_configs/fsdp.yaml (model {encoders['distilbert']}: "
                         "DistilBertForSequenceClassification, ") and ok.endswith(" M parameters)")
    assert note == ("accelerate_configs/fsdp.yaml: note: FSDP shards TransformerBlock one at a time (repeated "
                    "layers); outside this recipe write fsdp_transformer_layer_cls_to_wrap: TransformerBlock")


def test_loading_flags_reach_every_from_pretrained(encoders, tmp_path, monkeypatch):
    """--revision, --cache_dir and --trust_remote_code go to the config, model and tokenizer loads of the recipe, its
    start-up check and the checker's skeleton (a local folder ignores them, so the calls are captured)."""
    import transformers

    from recipes.checks import launch_checks
    from recipes.model import source

    seen = []

    def spy(cls_, original):
        def load(name, *args, **kwargs):
            seen.append((cls_, {k: kwargs.get(k) for k in ("revision", "cache_dir", "trust_remote_code")}))
            return original(name, *args, **kwargs)
        return load

    for name in ("AutoConfig", "AutoTokenizer", "AutoModelForSequenceClassification"):
        auto = getattr(transformers, name)
        monkeypatch.setattr(auto, "from_pretrained", spy(name, auto.from_pretrained))
    cache = str(tmp_path / "cache")
    cfg = cls.parse_config(["--model_name_or_path", str(encoders["distilbert"]), "--revision", "v1.0",
                            "--problem_type", "single_label",
                            "--cache_dir", cache, "--trust_remote_code"])
    source.check_model_source(cfg)
    source.load_tokenizer(cfg)
    cls.build_model(cfg, ["0", "1"])
    launch_checks.model_skeleton(cfg.model_name_or_path, **source.loading_kwargs(cfg))
    wanted = {"revision": "v1.0", "cache_dir": cache, "trust_remote_code": True}
    assert {c for c, _ in seen} == {"AutoConfig", "AutoTokenizer", "AutoModelForSequenceClassification"}
    assert [kwargs for _, kwargs in seen if kwargs != wanted] == []
