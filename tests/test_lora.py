"""LoRA through PEFT (--use_peft, recipes/model/adapters.py) on the pretrained encoder cut to 2 layers (conftest's
`cut_pretrained`: BERT, so a pooler, which the recipe trains in full with the classifier), fp32 without dropout.

One reference run (one process, `python recipes/cls.py --data_parallel`: on this CPU-only machine nn.DataParallel falls
back to one device, the way tests/test_recipe.py rehearses it; DataParallel over several GPUs did not run here), and
one launch per strategy, each checked for several things:
- per-step losses of DDP, FSDP2, ZeRO-2 and ZeRO-3 (2 processes) follow the one-process run within LOSS_ATOL;
- final/adapter/ of FSDP2 and ZeRO-3 is complete: every tensor equals the one-process run's within ADAPTER_ATOL, the
  half that rank 1 holds (FSDP2's dim-0 shard, ZeRO-3's flat partition) included, and changed from init;
- merged final/ gives the logits of base + adapter within MERGE_ATOL, loads in pipeline(), and its frozen tensors are
  bit-identical to the pretrained file; the adapter loads from a copy of the folder elsewhere, also through
  AutoPeftModelForSequenceClassification; the same under the shipped bf16 ZeRO-3 and FSDP2 configs, where the
  engine holds the base in bf16 or computes in it (a merge from a bf16 copy would round every frozen tensor), and
  adapter/ holds fp32 values;
- the live model's frozen weights in the last checkpoint are bit-identical to the pretrained file;
- a resume mid-run equals the uninterrupted run (same process count: exactly; from DDP's 2-process checkpoint on one
  process: within LOSS_ATOL); ZeRO-3's and FSDP2's 2-process checkpoints resumed on one process (universal
  conversion; torch.distributed.checkpoint's resharding) follow it within LOSS_ATOL and start from a frozen base
  bit-identical to the pretrained file.
In-process, no launch: the bad-input lines, the adapter folder's size against the predicted trainable count, and
--gradient_checkpointing's gradients against the plain model's.
"""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import PRETRAINED_DATA, fp32_launch_args, losses, no_gpu, rank_records, run_recipe
from recipes import RecipeError, cls
from recipes.model import adapters, source

# 8 steps of 16 snippets (2 x 8 on two processes); rank 4 on every linear of the 2 layers
LORA = ["--use_peft", "--lora_r", "4", "--lora_dropout", "0"]
RUN = [*PRETRAINED_DATA, *LORA, "--max_train_steps", "8", "--learning_rate", "1e-3"]
# Checkpoints at steps 4 and 8 only in the runs whose checkpoints are read: the one-process reference's (steps 4 and
# 8) and DDP's, FSDP2's and ZeRO-3's (step 4, resumed); the resumed runs save none (--checkpointing_steps is exempt
# from the resume contract)
CHECKPOINTED = ["--checkpointing_steps", "4"]
RESUMED = {"ddp.yaml", "fsdp.yaml", "zero3.yaml"}
# The shipped bf16 configs: 4 steps, no checkpoint, so that nothing runs between the save of best/ and of final/ (a
# checkpoint's collectives hid FSDP2's stale unsharded root there: recipes/model/adapters.py, trained_state)
BF16_RUN = [*PRETRAINED_DATA, *LORA, "--max_train_steps", "4", "--learning_rate", "1e-3"]
# Bounds, fp32 on this CPU (measured: each test prints its figure). Losses of DDP, FSDP2, ZeRO-2 and ZeRO-3 vs one
# process: 6.0e-8 at most over the 8 steps (one ulp of a loss near 0.69); the bound allows about 8 ulp, as
# tests/test_pretrained.py's, while a lost adapter gradient or a wrong scale moves a loss by 1e-4 or more. Adapter and
# head tensors after 8 steps vs one process: 5.3e-7 at most (ZeRO-3; DDP, ZeRO-2 and FSDP2 4.1e-7): Adam divides each
# update by sqrt(v), so rounding differences of the gradient reach the weights enlarged; 10x that. Merged final/ vs
# base + adapter logits: 1.5e-8 (bf16 runs: ZeRO-3 2.2e-8, FSDP2 7.5e-9; W + B A summed once vs x W + x A^T B^T),
# bound 1e-6. Resume on the same process
# count: equal (0); DDP's 2-process checkpoint on one process: 0 measured, bound LOSS_ATOL.
LOSS_ATOL = 5e-7
ADAPTER_ATOL = 5e-6
MERGE_ATOL = 1e-6
TEXTS = ["a gripping, beautifully acted film", "dull and far too long", "not bad at all"]

pytestmark = no_gpu  # CPU rehearsal: gloo, FSDP and DeepSpeed on CPU


def model_flag(cut_pretrained):
    return ["--model_name_or_path", str(cut_pretrained)]


@pytest.fixture(scope="module")
def reference(cut_pretrained, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_one_process")
    run_recipe(out, *model_flag(cut_pretrained), *RUN, *CHECKPOINTED, "--per_device_train_batch_size", "16",
               "--data_parallel", config=None)
    return out


@pytest.fixture(scope="module")
def runs(cut_pretrained, tmp_path_factory):
    """One 2-process launch per config, made once and shared ("<name>_bf16.yaml": the shipped <name>.yaml as it
    is, with BF16_RUN; the others in fp32 with RUN)."""
    made = {}

    def get(config: str):
        if config not in made:
            out = tmp_path_factory.mktemp(config.replace(".yaml", ""))
            shipped, bf16 = config.replace("_bf16", ""), config.endswith("_bf16.yaml")
            run_recipe(out / "run", *model_flag(cut_pretrained), *(BF16_RUN if bf16 else RUN),
                       *(CHECKPOINTED if config in RESUMED else []), "--per_device_train_batch_size", "8",
                       config=shipped,
                       launch_args=[] if bf16 else fp32_launch_args(shipped, out))
            made[config] = out / "run"
        return made[config]
    return get


def logits(model, tokenizer) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**tokenizer(TEXTS, return_tensors="pt", padding=True)).logits.float()


def load_adapter_as_documented(adapter):
    """docs/lora.md's lines: the base named in adapter_config.json, built with the classifier's config kept beside
    the adapter (labels, problem type, dtype), then the adapter and head on it."""
    from peft import PeftConfig, PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(
        PeftConfig.from_pretrained(adapter).base_model_name_or_path, config=AutoConfig.from_pretrained(adapter),
        ignore_mismatched_sizes=True)
    return PeftModel.from_pretrained(base, adapter)


def assert_merged_equals_base_plus_adapter(out, cut_pretrained, tmp_path, label: str) -> float:
    """final/ against the fp32 base + final/adapter/ (read from a copy on another path); returns the max difference."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    copy = tmp_path / f"adapter_copy_{label}"
    shutil.copytree(out / "final" / "adapter", copy)
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    merged = AutoModelForSequenceClassification.from_pretrained(out / "final", dtype=torch.float32)
    config = merged.config
    base = AutoModelForSequenceClassification.from_pretrained(cut_pretrained, config=config, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, copy)
    documented = load_adapter_as_documented(copy)
    want, got, via_docs = logits(adapted, tokenizer), logits(merged, tokenizer), logits(documented, tokenizer)
    delta = float((want - got).abs().max())
    print(f"{label}: max |merged final/ logits - base + adapter logits| = {delta:.3e}")
    assert delta <= MERGE_ATOL
    assert torch.equal(want, via_docs)
    predictions = pipeline("text-classification", model=str(out / "final"), device="cpu")(TEXTS)
    assert [p["label"] for p in predictions] == [config.id2label[int(i)] for i in got.argmax(-1)]
    return delta


def assert_frozen_tensors_bit_identical(merged: dict, cut_pretrained, targets_changed: bool = True) -> None:
    """merged final/'s tensors that LoRA does not touch (embeddings, norms, biases) equal the file's bit for bit;
    the adapted weights, the pooler and the classifier changed."""
    files = {f"bert.{k}": v for k, v in load_file(cut_pretrained / "model.safetensors").items()
             if k != "embeddings.position_ids"}
    assert set(merged) == set(files) | {"classifier.weight", "classifier.bias"}
    adapted = {k for k in files if k.startswith("bert.encoder.layer.") and k.endswith(".weight")
               and "LayerNorm" not in k}
    assert len(adapted) == 2 * 6
    for key, tensor in files.items():
        same = torch.equal(merged[key], tensor)
        assert same == (key not in adapted and not key.startswith("bert.pooler.")), key


def file_key(peft_key: str) -> str:
    """The pretrained file's name (a BertModel file: no `bert.` prefix) of a frozen tensor of the PEFT model."""
    return peft_key.replace("base_model.model.bert.", "").replace(".base_layer.", ".").replace(".original_module.", ".")


@pytest.mark.multiproc
def test_one_process_trains_adapter_and_head_only(reference, cut_pretrained, tmp_path):
    from transformers import AutoConfig

    config = json.loads((reference / "run_config.json").read_text())
    assert config["mixed_precision"] == "no" and config["world_size"] == 1
    predicted = adapters.trainable_count(AutoConfig.from_pretrained(cut_pretrained), 4, 2)["total"]
    assert config["lora"]["trainable_params"] == predicted and config["lora"]["r"] == 4
    assert len(losses(reference)) == 8
    merged = load_file(reference / "final" / "model.safetensors")
    assert_frozen_tensors_bit_identical(merged, cut_pretrained)
    assert_merged_equals_base_plus_adapter(reference, cut_pretrained, tmp_path, "one process")
    # the live model's frozen base in the last checkpoint: the pretrained tensors, bit for bit
    state = load_file(reference / "checkpoints" / "step_8" / "model.safetensors")
    files = load_file(cut_pretrained / "model.safetensors")
    frozen = {k: v for k, v in state.items() if "lora_" not in k and "modules_to_save" not in k}
    checked = 0
    for key, tensor in frozen.items():
        if file_key(key) in files:
            assert torch.equal(tensor, files[file_key(key)]), key
            checked += 1
    assert checked == len(files) - 1  # every file tensor but the position ids buffer
    adapter = load_file(reference / "final" / "adapter" / "adapter_model.safetensors")
    head = {k for k in adapter if "lora_" not in k}
    assert head == {"base_model.model.bert.pooler.dense.weight", "base_model.model.bert.pooler.dense.bias",
                    "base_model.model.classifier.weight", "base_model.model.classifier.bias"}, head
    assert sum("lora_A" in k for k in adapter) == sum("lora_B" in k for k in adapter) == 2 * 6
    best = load_file(reference / "best" / "adapter" / "adapter_model.safetensors")
    assert set(best) == set(adapter)
    base_name = json.loads((reference / "final" / "adapter" / "adapter_config.json").read_text())
    assert base_name["base_model_name_or_path"] == str(cut_pretrained.resolve())


@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["ddp.yaml", "fsdp.yaml", "zero2.yaml", "zero3.yaml"])
def test_strategies_follow_one_process(reference, runs, cut_pretrained, tmp_path, config):
    out = runs(config)
    a, b = losses(reference), losses(out)
    delta = max(abs(x - y) for x, y in zip(a, b))
    print(f"lora {config} (2 processes) vs one process: max |loss difference| over 8 steps = {delta:.3e}")
    assert len(a) == len(b) == 8 and delta <= LOSS_ATOL, (a, b)
    want = load_file(reference / "final" / "adapter" / "adapter_model.safetensors")
    got = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    assert set(got) == set(want)
    worst = 0.0
    for key, tensor in got.items():
        assert tensor.numel() > 0 and tensor.shape == want[key].shape, key
        worst = max(worst, float((tensor - want[key]).abs().max()))
        flat = tensor.flatten()
        rank1 = flat[flat.numel() // 2:]  # the second half: rank 1's shard (FSDP2 dim 0) or partition (ZeRO-3)
        if "lora_B" in key:  # zero at init
            assert rank1.abs().max() > 0, key
    print(f"lora {config}: max |adapter tensor - one process's| = {worst:.3e}")
    assert worst <= ADAPTER_ATOL
    assert_frozen_tensors_bit_identical(load_file(out / "final" / "model.safetensors"), cut_pretrained)
    if config in ("fsdp.yaml", "zero3.yaml"):
        assert_merged_equals_base_plus_adapter(out, cut_pretrained, tmp_path, config)


@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["zero3_bf16.yaml", "fsdp_bf16.yaml"])
def test_bf16_saves_fp32_adapters_and_merges_from_the_fp32_base(runs, cut_pretrained, tmp_path, config):
    """ZeRO-3 holds the base in bf16 and the adapters' fp32 master in the optimizer; FSDP2 computes in bf16 from fp32
    shards. adapter/ holds fp32 values (not bf16 ones widened: low mantissa bits set in every tensor of the head and
    in some lora_B), complete; the merged final/ is the fp32 base + that adapter, its frozen tensors the file's."""
    out = runs(config)
    assert json.loads((out / "run_config.json").read_text())["mixed_precision"] == "bf16"
    assert_frozen_tensors_bit_identical(load_file(out / "final" / "model.safetensors"), cut_pretrained)
    adapter = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 12 + 4 and {t.dtype for t in adapter.values()} == {torch.float32}

    def low_bits(t):
        return bool(((t.view(torch.int32) & 0xFFFF) != 0).any())
    assert all(low_bits(t) for k, t in adapter.items() if "lora_" not in k)
    assert any(low_bits(t) for k, t in adapter.items() if "lora_B" in k)
    assert all(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)
    assert_merged_equals_base_plus_adapter(out, cut_pretrained, tmp_path, config)


@pytest.mark.multiproc
def test_resume_mid_run_equals_the_uninterrupted_run(reference, runs, cut_pretrained, tmp_path):
    again = tmp_path / "same_count"
    shutil.copytree(reference / "checkpoints" / "step_4", again / "checkpoints" / "step_4")
    run_recipe(again, *model_flag(cut_pretrained), *RUN, "--per_device_train_batch_size", "16", "--data_parallel",
               "--resume_from_checkpoint", str(again / "checkpoints" / "step_4"), config=None)
    assert losses(again) == losses(reference)[4:]
    assert load_file(again / "final" / "adapter" / "adapter_model.safetensors").keys() == \
        load_file(reference / "final" / "adapter" / "adapter_model.safetensors").keys()
    for key, tensor in load_file(again / "final" / "adapter" / "adapter_model.safetensors").items():
        assert torch.equal(tensor, load_file(reference / "final" / "adapter" / "adapter_model.safetensors")[key])
    # DDP's 2-process checkpoint resumed on one process
    other = tmp_path / "other_count"
    shutil.copytree(runs("ddp.yaml") / "checkpoints" / "step_4", other / "checkpoints" / "step_4")
    run_recipe(other, *model_flag(cut_pretrained), *RUN, "--per_device_train_batch_size", "16",
               "--resume_from_checkpoint", str(other / "checkpoints" / "step_4"), config="single.yaml",
               launch_args=fp32_launch_args("single.yaml", tmp_path))
    delta = max(abs(x - y) for x, y in zip(losses(other), losses(reference)[4:]))
    print(f"lora ddp step 4 resumed on one process: max |loss difference| over steps 5-8 = {delta:.3e}")
    assert len(losses(other)) == 4 and delta <= LOSS_ATOL


@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["zero3.yaml", "fsdp.yaml"])
def test_resume_on_one_process_keeps_the_frozen_base(reference, runs, cut_pretrained, tmp_path, config):
    """A 2-process checkpoint on one process, the elastic path of each sharded strategy: ZeRO-3's universal
    conversion carries only the optimizer's partitions (adapters + head), so the frozen base is the one built from the
    pretrained files; FSDP2's torch.distributed.checkpoint reshards the whole model state, frozen base included. The
    weights the resumed run starts from (--record_ranks: fingerprints gathered after the load) are the file's, bit
    for bit, and its losses follow the one-process run."""
    from recipes.testing.probe import fingerprint

    out = tmp_path / "to_one"
    shutil.copytree(runs(config) / "checkpoints" / "step_4", out / "checkpoints" / "step_4")
    launch = fp32_launch_args(config, tmp_path) + ["--num_processes", "1"]
    run_recipe(out, *model_flag(cut_pretrained), *RUN, "--per_device_train_batch_size", "16", "--record_ranks",
               "--resume_from_checkpoint", str(out / "checkpoints" / "step_4"), config=config,
               launch_args=launch)
    assert (out / "checkpoints" / "step_4.universal").is_dir() == (config == "zero3.yaml")
    delta = max(abs(x - y) for x, y in zip(losses(out), losses(reference)[4:]))
    print(f"lora {config} step 4 resumed on one process: max |loss difference| over steps 5-8 = {delta:.3e}")
    assert len(losses(out)) == 4 and delta <= LOSS_ATOL
    files = load_file(cut_pretrained / "model.safetensors")
    start = rank_records(out)[0]["start_weights"]
    frozen = {k: v for k, v in start.items() if file_key(k) in files and "lora_" not in k
              and "modules_to_save" not in k}
    assert len(frozen) == len(files) - 1  # every file tensor but the position ids buffer
    for key, seen in frozen.items():
        assert seen["sha256"] == fingerprint(files[file_key(key)])["sha256"], key


# ---- in-process: bad input, DataParallel unwrapping, the adapter's size ------------------------------------------

def refusal(check, *flags) -> str:
    with pytest.raises(RecipeError) as caught:
        check(cls.parse_config(["--output_dir", "/nonexistent/out", *flags]))
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_lora_flags_without_use_peft_is_one_line():
    with pytest.raises(RecipeError) as caught:
        cls.parse_config(["--lora_r", "16", "--lora_target_modules", "query"])
    assert str(caught.value) == "--lora_r, --lora_target_modules without --use_peft: add --use_peft to train LoRA " \
                                "adapters"


def test_missing_peft_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft then raises ImportError
    with pytest.raises(RecipeError) as caught:
        cls.parse_config(["--use_peft"])
    assert str(caught.value) == f"--use_peft needs the peft package: {adapters.INSTALL}"


def test_target_naming_no_module_is_one_line(cut_pretrained):
    line = refusal(source.check_model_source, "--model_name_or_path", str(cut_pretrained), "--use_peft",
                   "--lora_target_modules", "query,q_proj")
    assert line.startswith("--lora_target_modules q_proj: no module of BertForSequenceClassification is named so")


def test_default_targets_are_the_layers_linears_not_pooler_or_head(cut_pretrained):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(cut_pretrained)
    targets = adapters.default_targets(model)
    assert len(targets) == 2 * 6 and not any("pooler" in t or "classifier" in t for t in targets)
    assert adapters.head_modules(model) == ["classifier", "bert.pooler"]


def test_data_parallel_unwraps_to_the_adapted_model(cut_pretrained, tmp_path):
    """nn.DataParallel on CPU (no GPU: it calls the module itself): the trained state is read from the module
    Accelerate unwraps, with PEFT's names."""
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification

    cfg = cls.parse_config(["--model_name_or_path", str(cut_pretrained), "--output_dir", str(tmp_path), *LORA])
    model = adapters.apply(cfg, AutoModelForSequenceClassification.from_pretrained(cut_pretrained))
    accelerator = Accelerator(cpu=True)
    state = adapters.trained_state(accelerator, accelerator.unwrap_model(torch.nn.DataParallel(model)))
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad} and len(state) == 2 * 12 + 4


def test_adapter_size_matches_the_predicted_trainable_count(tmp_path):
    """roberta-large's shape (random init, no training step): adapter_model.safetensors holds the predicted
    trainable count of fp32 values, within 1% (the file's header and names are the rest)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from helpers import REPO

    folder = REPO / "artifacts" / "roberta-large-shape"
    config = AutoConfig.from_pretrained(folder, num_labels=2)
    cfg = cls.parse_config(["--model_name_or_path", str(folder), "--output_dir", str(tmp_path), "--use_peft"])
    model = adapters.apply(cfg, AutoModelForSequenceClassification.from_config(config))
    predicted = adapters.trainable_count(config, cfg.lora_r, 2)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == predicted["total"]
    model.save_pretrained(tmp_path / "adapter")
    size = (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    print(f"roberta-large shape, r {cfg.lora_r}: {predicted} trainable, file {size} bytes, "
          f"{size / (4 * predicted['total']) - 1:+.4%} over 4 bytes each")
    assert abs(size / (4 * predicted["total"]) - 1) <= 0.01


def test_memory_model_counts_gradients_and_adam_of_the_trainable_part_only():
    """scripts/memory_model.py --lora_r: the skeleton's trainable count is the predicted one; one process holds fp32
    gradients and two Adam moments of those parameters only, fp32 weights of all of them (base + adapters + head's
    trained copy)."""
    from helpers import REPO
    from scripts import memory_model
    from transformers import AutoConfig

    folder = str(REPO / "artifacts" / "roberta-large-shape")
    shape = memory_model.shape_from_model(folder, 2, lora_r=8)
    full = memory_model.shape_from_model(folder, 2)
    predicted = adapters.trainable_count(AutoConfig.from_pretrained(folder), 8, 2)
    assert shape.trainable_params == predicted["total"] and shape.num_params == full.num_params + predicted["total"]
    parts = {p.what: p.nbytes for p in memory_model.predict("single", shape, 1, "fp32")}
    assert parts == {"fp32 parameters": 4 * shape.num_params, "fp32 gradients": 4 * predicted["total"],
                     "optimizer moments": 8 * predicted["total"]}
    zero2 = {p.what: p.nbytes for p in memory_model.predict("zero2", shape, 8, "bf16")}
    assert zero2["fp32 master partition"] == 4 * -(-predicted["total"] // 8)


def test_gradient_checkpointing_gives_the_same_adapter_gradients(cut_pretrained, tmp_path):
    """--gradient_checkpointing with --use_peft (recipes/model/activation_checkpointing.py on the PEFT model): the
    frozen embeddings' output needs no gradient, so torch's non-reentrant checkpoint (the recipe's choice) still reaches
    the adapters of every layer; loss and every trainable gradient equal the plain model's, in-process, no launch."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from recipes.model import activation_checkpointing

    cfg = cls.parse_config(["--model_name_or_path", str(cut_pretrained), "--output_dir", str(tmp_path), *LORA])
    tokenizer = AutoTokenizer.from_pretrained(cut_pretrained)
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = adapters.apply(cfg, AutoModelForSequenceClassification.from_pretrained(cut_pretrained))
        for name, p in model.named_parameters():  # LoRA's B starts at zero: make A's gradient non-zero too
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        activation_checkpointing.apply(model, checkpointed, env={})
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointed
        model.train()
        loss = model(**batch, labels=torch.tensor([1, 0, 1])).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (plain_loss, plain), (ckpt_loss, ckpt) = grads
    assert set(plain) == set(ckpt) and len(plain) == 2 * 12 + 4
    assert all(g.abs().sum() > 0 for g in ckpt.values())  # every adapter and head tensor gets a gradient
    worst = max(float((plain[n] - ckpt[n]).abs().max()) for n in plain)
    print(f"gradient checkpointing with LoRA: loss {float(plain_loss):.6f} vs {float(ckpt_loss):.6f}, "
          f"max |grad difference| {worst:.2e}")
    assert torch.equal(plain_loss, ckpt_loss) and worst <= 1e-6


class OneProcess:
    """What adapters.weights_writer asks of an Accelerator on one process."""
    from accelerate.utils import DistributedType

    distributed_type = DistributedType.NO


TASKS = {  # problem type, label names, flags: a 3-label run on the 2-label file needs --ignore_mismatched_sizes
    "single_label_3": ("single_label", ["neg", "neutral", "pos"], ["--ignore_mismatched_sizes"]),
    "single_label_2": ("single_label", ["bad", "good"], []),
    "regression": ("regression", ["score"], []),
    "multi_label": ("multi_label", ["a", "b", "c"], ["--ignore_mismatched_sizes"]),
}


@pytest.mark.parametrize("task", TASKS)
def test_adapter_folder_loads_as_documented_for_every_task_type(tiny_model, tmp_path, task):
    """In process, no launch: the recipe's adapted model (cls.build_model, the tiny RoBERTa file with its 2-label
    head), its adapters and head moved from init, written as a run writes final/: the adapter folder loaded as
    docs/lora.md shows gives the merged final/'s logits within MERGE_ATOL, with the run's label names and problem
    type, for every task type. Before: a 3-label run's merge raised at the first save (--ignore_mismatched_sizes was
    not passed to it) and AutoPeftModelForSequenceClassification named 2 labels LABEL_0/1."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from recipes.inputs.problem import HF_PROBLEM_TYPE
    from recipes.model.identity import folder_identity, is_model_file

    problem_type, names, flags = TASKS[task]
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    cfg = cls.parse_config(["--model_name_or_path", str(base), "--output_dir", str(tmp_path / "run"),
                            "--problem_type", problem_type, *LORA, *flags])
    pinned = folder_identity(str(base), is_model_file, source.loading_kwargs(cfg))
    model = cls.build_model(cfg, names, pinned)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:  # adapters (lora_B starts at 0) and the head, as training would leave them
                param.add_(torch.randn_like(param) * 0.05)
    final = tmp_path / "run" / "final"
    adapters.weights_writer(OneProcess(), model)(final)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    merged = AutoModelForSequenceClassification.from_pretrained(final)
    documented = load_adapter_as_documented(final / "adapter")
    want, got = logits(merged, tokenizer), logits(documented, tokenizer)
    print(f"{task}: max |adapter as documented - merged final/| = {float((want - got).abs().max()):.2e}")
    assert want.shape == (len(TEXTS), len(names)) and torch.allclose(got, want, atol=MERGE_ATOL, rtol=0)
    config = documented.get_base_model().config
    assert [config.id2label[i] for i in range(len(names))] == names == \
        [merged.config.id2label[i] for i in range(len(names))]
    assert config.problem_type == merged.config.problem_type == HF_PROBLEM_TYPE[problem_type]
    # the base changed on disk after the run started: the next merge refuses it in one line
    (base / "config.json").write_text((base / "config.json").read_text() + "\n")
    with pytest.raises(RecipeError, match=r"the LoRA base .* changed since the run started \(config.json\)"):
        adapters.weights_writer(OneProcess(), model)(tmp_path / "again")
