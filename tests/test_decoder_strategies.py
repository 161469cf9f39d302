"""Decoder classifiers on every strategy, launched for real on 2 CPU processes (gloo), fp32: conftest's tiny
random-init Llama fine-tuned in full, its tiny Qwen2 (a tokenizer class with its own pad token, q/k/v biases) with
LoRA (--use_peft). Both have a new `score` head; neither has a trainable vector under LoRA.

One one-process run per mode is the reference (`python recipes/cls.py`, 16 samples a step). Each strategy run takes
the same 16 samples a step as 2 processes x 4 x accumulation 2, so one comparison checks loss parity with one fp32
process and exact accumulation (the encoder tests' bound):
    full: DDP, FSDP2 (decoder layers as units), ZeRO-3 (`score` built under zero.Init), ZeRO-2 with CPU offload
    LoRA: FSDP2, ZeRO-3, ZeRO-1, ZeRO-3 with CPU offload
Each run: 101 evaluation examples counted once over 2 ranks (gather_for_metrics) and the reference's accuracy; the
head starts from the reference's values (initialised under zero.Init too); final/ loads with nothing missing (the
head saved), carries the pad id, and under LoRA: adapter/ complete from both ranks (every tensor the reference's,
lora_B non-zero in rank 1's half), the merged final/ = fp32 base + adapter with the base's frozen tensors bit for
bit, adapter/ loadable from a copy as docs/lora.md shows. `pipeline("text-classification")` on final/ reproduces the
run's last evaluation; a mid-run resume equals the uninterrupted run exactly (the head restored).
The sweep runner (one process per trial) runs the decoder with and without --padding_free, with length grouping,
class weights, gradient checkpointing and the evaluation report.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_FLAGS, fp32_launch_args, losses, no_gpu, rank_records, read_jsonl, run_recipe
from recipes import cls
from recipes.inputs import data

# The empty weight-decay group of LoRA on a bias-free decoder (adapters and `score` are all matrices) broke ZeRO-3's
# schedule at its first step before recipes/cls.py param_groups dropped empty groups: the ZeRO-3 LoRA runs show it.
pytestmark = [pytest.mark.multiproc, no_gpu]  # CPU rehearsal: gloo, FSDP and DeepSpeed on CPU

RUN = ["--max_train_steps", "8", "--record_ranks"]
# A checkpoint (at step 4, and the last step's) only in the runs that test_resume_mid_run_equals_the_uninterrupted_run
# resumes from; the other runs and the resumed ones save none (--checkpointing_steps is exempt from the resume contract)
RESUMED = {("full", "fsdp.yaml"), ("lora", "zero3.yaml")}
CHECKPOINTED = ["--checkpointing_steps", "4"]
LORA = ["--use_peft", "--lora_r", "4", "--lora_dropout", "0"]
ONE_PROCESS = ["--per_device_train_batch_size", "16"]
TWO_PROCESSES = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
FULL = ["ddp.yaml", "fsdp.yaml", "zero3.yaml", "zero2_offload.yaml"]
ADAPTED = ["fsdp.yaml", "zero3.yaml", "zero1.yaml", "zero3_offload.yaml"]
# Measured here: losses vs one process within 1.8e-7 (float32 sums in another order: 3 ulp of a loss near 0.7),
# adapter and head tensors within 2.4e-7, merged logits vs base + adapter within 6e-8: the encoder tests' bounds
# (tests/test_strategies.py, tests/test_lora.py) hold. A lost gradient or a wrong scale moves a loss by 1e-4 or more.
LOSS_ATOL = 5e-7
ADAPTER_ATOL = 5e-6
MERGE_ATOL = 1e-6
FINAL_ATOL = 1e-4  # final/ weights after 8 steps vs the reference's: Adam enlarges rounding differences


@pytest.fixture(scope="module")
def runs(tiny_decoders, tmp_path_factory):
    """One launch per (mode, config), made once and shared: ("full" or "lora", config or None for one process)."""
    made = {}

    def get(mode: str, config: str | None):
        if (mode, config) not in made:
            out = tmp_path_factory.mktemp(f"{mode}_{config or 'one'}".replace(".yaml", ""))
            model = tiny_decoders["llama" if mode == "full" else "qwen2"]
            flags = [*RUN, *(LORA if mode == "lora" else []), *(TWO_PROCESSES if config else ONE_PROCESS),
                     *(CHECKPOINTED if (mode, config) in RESUMED else [])]
            run_recipe(out / "run", "--model_name_or_path", str(model), *flags, config=config,
                       launch_args=fp32_launch_args(config, out) if config else ())
            made[mode, config] = out / "run"
        return made[mode, config]
    return get


def follows(ref, out, label: str) -> None:
    a, b = losses(ref), losses(out)
    delta = max(abs(x - y) for x, y in zip(a, b))
    print(f"{label}: max |loss - one process| over 8 steps = {delta:.3e}")
    assert len(a) == len(b) == 8 and delta <= LOSS_ATOL, (a, b)
    last, want = read_jsonl(out / "eval.jsonl")[-1], read_jsonl(ref / "eval.jsonl")[-1]
    assert last["n_examples"] == want["n_examples"] == 101 and last["accuracy"] == want["accuracy"]
    resolved = json.loads((out / "run_config.json").read_text())
    assert resolved["world_size"] == 2 and resolved["effective_batch_size"] == 16
    assert resolved["decoder"]["pad_token_id"] == json.loads((out / "final" / "config.json").read_text())[
        "pad_token_id"]


def head_start(out) -> dict:
    """The fingerprints of the head's starting values (rank 0's record, gathered where sharded)."""
    return {k: v["sha256"] for k, v in rank_records(out)[0]["start_weights"].items() if "score" in k}


def load_final(out):
    from transformers import AutoModelForSequenceClassification

    model, info = AutoModelForSequenceClassification.from_pretrained(out / "final", output_loading_info=True)
    assert not any(info.values()), info  # score included: a head left out would load freshly initialised
    return model


def assert_pipeline_reproduces_last_eval(out, model_folder) -> None:
    """transformers' pipeline on final/, one text at a time, over the run's 101 evaluation texts: the run's accuracy.
    (It pools as transformers does, the rightmost non-pad token: the last real one, as no text ends in eos.) The
    texts are cut at --max_length as the run cut them."""
    from transformers import pipeline

    cfg = cls.parse_config([*TINY_FLAGS, "--model_name_or_path", str(model_folder)])
    validation = data.load_raw_splits(cfg)[1]
    rows = data.kept_rows(validation, "text", cfg.max_eval_samples)
    texts, labels = [validation[i]["text"] for i in rows], [validation[i]["label"] for i in rows]
    predicted = pipeline("text-classification", model=str(out / "final"), device="cpu")(
        texts, truncation=True, max_length=cfg.max_length)  # cut as the run's tokenization cut them
    names = validation.features["label"].names
    accuracy = sum(p["label"] == names[y] for p, y in zip(predicted, labels)) / len(labels)
    assert len(labels) == 101 and accuracy == read_jsonl(out / "eval.jsonl")[-1]["accuracy"]


@pytest.mark.parametrize("config", FULL)
def test_full_fine_tuning_follows_one_process(runs, tiny_decoders, config):
    ref, out = runs("full", None), runs("full", config)
    follows(ref, out, f"full {config}")
    assert head_start(out) == head_start(ref) and len(head_start(ref)) == 1  # score.weight, no bias
    want, got = load_final(ref).state_dict(), load_final(out).state_dict()
    assert set(got) == set(want) and "score.weight" in got
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], atol=FINAL_ATOL, rtol=0, msg=name)
    if config == "zero3.yaml":
        assert_pipeline_reproduces_last_eval(out, tiny_decoders["llama"])
    if config == "fsdp.yaml":  # each decoder layer a unit of its own (fsdp_wrap: _no_split_modules), and the root
        units = rank_records(out)[0]["fsdp_units"]
        print(f"FSDP2 units: {units}")
        assert units[0] == "FSDPLlamaForSequenceClassification" and units.count("FSDPLlamaDecoderLayer") == 2


@pytest.mark.parametrize("config", ADAPTED)
def test_lora_follows_one_process_and_saves_complete_adapters(runs, tiny_decoders, tmp_path, config):
    ref, out = runs("lora", None), runs("lora", config)
    follows(ref, out, f"lora {config}")
    assert head_start(out) == head_start(ref)
    want = load_file(ref / "final" / "adapter" / "adapter_model.safetensors")
    got = load_file(out / "final" / "adapter" / "adapter_model.safetensors")
    assert set(got) == set(want) and "base_model.model.score.weight" in got
    assert sum("lora_A" in k for k in got) == 2 * 7
    worst = 0.0
    for key, tensor in got.items():
        worst = max(worst, float((tensor - want[key]).abs().max()))
        flat = tensor.flatten()
        if "lora_B" in key:  # zero at init: rank 1's half (FSDP2's dim-0 shard, ZeRO-3's partition) trained too
            assert flat[flat.numel() // 2:].abs().max() > 0, key
    print(f"lora {config}: max |adapter tensor - one process's| = {worst:.3e}")
    assert worst <= ADAPTER_ATOL
    base = load_file(tiny_decoders["qwen2"] / "model.safetensors")
    merged = load_file(out / "final" / "model.safetensors")
    assert set(merged) == {k for k in base if k != "lm_head.weight"} | {"score.weight"}
    adapted = {k for k in merged if k.endswith("proj.weight")}
    assert len(adapted) == 2 * 7
    for key, tensor in merged.items():
        if key != "score.weight":
            assert torch.equal(tensor, base[key]) == (key not in adapted), key
    if config in ("fsdp.yaml", "zero3.yaml"):
        assert_merged_is_base_plus_adapter(out, tiny_decoders["qwen2"], tmp_path)
    if config == "fsdp.yaml":
        assert_pipeline_reproduces_last_eval(out, tiny_decoders["qwen2"])


def assert_merged_is_base_plus_adapter(out, base_folder, tmp_path) -> None:
    """final/ against the fp32 base + final/adapter/ read from a copy elsewhere, through PEFT's auto class as
    docs/lora.md shows (the base named in adapter_config.json, an absolute path)."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer

    copy = tmp_path / "adapter_copy"
    shutil.copytree(out / "final" / "adapter", copy)
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    batch = tokenizer(["这个东西很好用", "质量一般般吧，物流也慢"], return_tensors="pt", padding=True)
    with torch.no_grad():
        merged = load_final(out).eval()(**batch).logits
        adapted = AutoPeftModelForSequenceClassification.from_pretrained(copy).eval()
        assert adapted.config.pad_token_id is None  # the base's files carry none: set it as docs/decoders.md says
        adapted.config.pad_token_id = tokenizer.pad_token_id
        both = adapted(**batch).logits
    delta = float((merged - both).abs().max())
    print(f"merged final/ vs base + adapter: max |logit difference| = {delta:.3e}")
    assert delta <= MERGE_ATOL


@pytest.mark.parametrize("mode,config", sorted(RESUMED))
def test_resume_mid_run_equals_the_uninterrupted_run(runs, tiny_decoders, tmp_path, mode, config):
    """The checkpoint of step 4, resumed on the same strategy: steps 5-8 equal the uninterrupted run's exactly (the
    head, the adapters and the optimizer state restored)."""
    out = runs(mode, config)
    again = tmp_path / "again"
    shutil.copytree(out / "checkpoints" / "step_4", again / "checkpoints" / "step_4")
    model = tiny_decoders["llama" if mode == "full" else "qwen2"]
    run_recipe(again, "--model_name_or_path", str(model), *RUN, *(LORA if mode == "lora" else []), *TWO_PROCESSES,
               "--resume_from_checkpoint", str(again / "checkpoints" / "step_4"), config=config,
               launch_args=fp32_launch_args(config, tmp_path))
    assert losses(again) == losses(out)[4:]
    assert read_jsonl(again / "eval.jsonl")[-1]["accuracy"] == read_jsonl(out / "eval.jsonl")[-1]["accuracy"]


def test_sweep_of_padding_free_with_grouping_class_weights_checkpointing_and_report(tiny_decoders, tmp_path):
    """scripts/sweep.py over --padding_free false/true on the tiny Llama, one process each, with --group_by_length,
    --class_weights balanced, --gradient_checkpointing, accumulation 2 and the evaluation report: both trials finish,
    the packed run's per-step losses and evaluation follow the padded one's (the same sequences, each pooled at its
    last token), the sweep's report holds both scores, each eval_report/ counts the 32 evaluation examples."""
    from helpers import python, run_in_own_group

    space = tmp_path / "space.yaml"
    space.write_text("padding_free: [false, true]\n")
    out = tmp_path / "sweep"
    fixed = ["--model_name_or_path", str(tiny_decoders["llama"]), "--max_train_samples", "64", "--max_eval_samples",
             "32", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
             "--per_device_eval_batch_size", "16", "--cpu_threads", "1", "--max_train_steps", "6", "--eval_steps", "3",
             "--logging_steps", "1", "--learning_rate", "1e-3", "--group_by_length", "--class_weights", "balanced",
             "--gradient_checkpointing", "--eval_report", "true"]
    proc = run_in_own_group([python(), "scripts/sweep.py", "--space", str(space), "--seeds", "1", "--output_dir",
                             str(out), "--metric", "loss", "--", *fixed], 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert sorted(t["state"] for t in report["trials"]) == ["COMPLETE", "COMPLETE"]
    padded, packed = (out / "trials" / f"padding_free={v},seed=42" for v in ("False", "True"))
    a, b = losses(padded), losses(packed)
    delta = max(abs(x - y) for x, y in zip(a, b))
    print(f"sweep: packed vs padded decoder runs, max |loss difference| over 6 steps = {delta:.3e}")
    assert len(a) == len(b) == 6 and delta <= LOSS_ATOL
    values = sorted(t["value"] for t in report["trials"])
    assert values[1] - values[0] <= LOSS_ATOL
    for trial in (padded, packed):
        resolved = json.loads((trial / "run_config.json").read_text())
        assert resolved["config"]["class_weights"] == "balanced" and resolved["config"]["group_by_length"]
        assert [r.get("weight_sum") is not None for r in read_jsonl(trial / "metrics.jsonl")] == [True] * 6
        scores = json.loads((trial / "eval_report" / "report.json").read_text())
        assert sum(c["support"] for c in scores["per_class"].values()) == scores["n_examples"] == 32
        assert scores["accuracy"] == read_jsonl(trial / "eval.jsonl")[-1]["accuracy"]
    assert json.loads((packed / "run_config.json").read_text())["kernels"]["attn_implementation"] == \
        "padding_free_sdpa"

