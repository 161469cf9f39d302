"""Elastic resume (issue 11): a checkpoint continued on another number of processes is the same training.

Every case: an uninterrupted run writes a checkpoint mid-epoch 1, the checkpoint is resumed on another world size with
the same global batch (8 per device x accumulation x processes = 16), and the resumed run is compared with the
uninterrupted one: per-step losses after the resume point, the samples each step covered, the final weights.
Tiny model without dropout (a world-size change gives other dropout streams), fp32.

Tolerances: the resumed run sums the same samples' gradients in another grouping (1 process x 2 micro-batches instead
of 2 ranks x 1 and an all-reduce) and pads them to other lengths, so float32 rounding (~1e-7 per step) may differ:
ATOL = 1e-5 on losses, WEIGHT_ATOL = 1e-6 on the final weights (measured at most 7.5e-9; ZeRO-3 resumed without the
universal-load repair in recipes/checkpoints/elastic.py ends 8.7e-6 away, so this bound catches it). Sample ids: equal
exactly.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import fp32_launch_args, losses, rank_records, read_jsonl, run_recipe
from recipes.inputs import data

pytestmark = pytest.mark.multiproc

# 64 samples, global batch 16: 4 steps per epoch, 8 in all; the checkpoint at step 6 sits mid-epoch 1 (sample 32).
FLAGS = ["--max_train_samples", "64", "--max_eval_samples", "16", "--per_device_train_batch_size", "8",
         "--num_train_epochs", "2", "--record_ranks"]
STEPS, RESUME_STEP, SAMPLES_AT_RESUME = 8, 6, 32
ATOL, WEIGHT_ATOL = 1e-5, 1e-6


def launch(config: str, procs: int, tmp_path) -> dict:
    """run_recipe's config and launch args: fp32, on `procs` processes (DDP on one process is single.yaml)."""
    if config == "ddp.yaml" and procs == 1:
        return {"config": "single.yaml", "launch_args": fp32_launch_args("single.yaml", tmp_path)}
    one = ["--num_processes", "1"] if procs == 1 else []
    return {"config": config, "launch_args": fp32_launch_args(config, tmp_path) + one}


def ga(n: int) -> list[str]:
    return ["--gradient_accumulation_steps", str(n)]


@pytest.fixture(scope="module")
def no_dropout(no_dropout_model):
    return ["--model_name_or_path", str(no_dropout_model)]


@pytest.fixture(scope="module")
def reference(no_dropout, tmp_path_factory):
    """Uninterrupted runs with a checkpoint at RESUME_STEP, made once per (config, processes) and shared."""
    made = {}

    def get(config: str, procs: int):
        if (config, procs) not in made:
            out = tmp_path_factory.mktemp(f"ref_{config[:-5]}_{procs}")
            run_recipe(out, *no_dropout, *FLAGS, *ga(2 // procs),
                       "--checkpointing_steps", str(RESUME_STEP),
                       **launch(config, procs, out))
            assert len(losses(out)) == STEPS
            made[config, procs] = out
        return made[config, procs]

    return get


def step_samples(out, accum: int) -> list[list[int]]:
    """The sorted sample ids each optimizer step covered, from all ranks' records (micro-batches grouped by step)."""
    records = rank_records(out)
    n_micro = len(records[0]["sample_ids"])
    return [sorted(i for r in records for m in r["sample_ids"][s:s + accum] for i in m)
            for s in range(0, n_micro, accum)]


def final_weights(out) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


def assert_same_training(ref, ref_procs: int, resumed, procs: int, label: str) -> float:
    """Losses after the resume, samples per step, final weights and final eval equal the uninterrupted run's."""
    got, want = losses(resumed), losses(ref)
    assert len(got) == STEPS and got[:RESUME_STEP] == want[:RESUME_STEP]  # the records before the checkpoint kept
    delta = max(abs(a - b) for a, b in zip(got[RESUME_STEP:], want[RESUME_STEP:]))
    w_ref, w_got = final_weights(ref), final_weights(resumed)
    param_delta = max((w_ref[k] - w_got[k]).abs().max().item() for k in w_ref)
    print(f"{label}: max |loss diff| after resume {delta:.1e}, max |weight diff| {param_delta:.1e}")
    assert delta <= ATOL and param_delta <= WEIGHT_ATOL
    # Steps 7 and 8 (epoch 1 after sample 32) cover the same samples: the last 2 steps of the reference.
    assert step_samples(resumed, 2 // procs) == step_samples(ref, 2 // ref_procs)[-(STEPS - RESUME_STEP):]
    # The consumed samples of epoch 1 are skipped by `accelerator.skip_first_batches`, in this layout's micro-batches.
    assert rank_records(resumed)[0]["epochs"][0] == {"epoch": 1, "batch_sampler": "SkipBatchSampler",
                                                     "skipped_batches": SAMPLES_AT_RESUME // (8 * procs)}
    assert read_jsonl(resumed / "eval.jsonl")[-1]["accuracy"] == read_jsonl(ref / "eval.jsonl")[-1]["accuracy"]
    # allowed without --force_resume, and recorded (the model card lists it too)
    changes = json.loads((resumed / "run_config.json").read_text())["training_contract"]["changes"]
    assert changes == [{"name": "world_size", "before": ref_procs, "after": procs, "step": RESUME_STEP}]
    return delta


def resume(ref, tmp_path, no_dropout, config: str, procs: int, *extra, check=True):
    out = tmp_path / f"resumed_{procs}"
    out.mkdir()
    shutil.copy(ref / "metrics.jsonl", out)  # the interrupted run's records, truncated at the checkpoint
    shutil.copy(ref / "eval.jsonl", out)
    proc = run_recipe(out, *no_dropout, *FLAGS, *ga(2 // procs), *extra, "--resume_from_checkpoint",
                      str(ref / "checkpoints" / f"step_{RESUME_STEP}"), **launch(config, procs, tmp_path),
                      check=check)
    return out, proc


CASES = [("ddp.yaml", 2, 1), ("ddp.yaml", 1, 2), ("fsdp.yaml", 2, 1), ("zero2.yaml", 2, 1), ("zero3.yaml", 2, 1),
         ("zero3.yaml", 1, 2)]


@pytest.mark.parametrize("config,before,after", CASES, ids=[f"{c[:-5]}-{b}to{a}" for c, b, a in CASES])
def test_resume_on_other_world_size_is_the_same_training(reference, no_dropout, tmp_path, config, before, after):
    ref = reference(config, before)
    state = json.loads((ref / "checkpoints" / f"step_{RESUME_STEP}" / "trainer_state.json").read_text())
    assert (state["epoch"], state["samples_in_epoch"]) == (1, SAMPLES_AT_RESUME)
    out, _ = resume(ref, tmp_path, no_dropout, config, after)
    assert_same_training(ref, before, out, after, f"{config} {before}->{after}")
    if config.startswith("zero"):  # converted next to the original, which stays as it was
        assert (ref / "checkpoints" / f"step_{RESUME_STEP}.universal").is_dir()
        assert not (ref / "checkpoints" / f"step_{RESUME_STEP}.universal.tmp").exists()


def test_other_global_batch_refused_then_forced(reference, no_dropout, tmp_path):
    ref = reference("ddp.yaml", 2)
    # 1 process x 8 x accumulation 1 = 8 samples per step instead of 16: refused, with the numbers.
    proc = run_recipe(tmp_path / "refused", *no_dropout, *FLAGS, "--resume_from_checkpoint",
                      str(ref / "checkpoints" / f"step_{RESUME_STEP}"), config=None, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "global batch 16 (8 per device x 1 accumulation x 2 processes) -> 8 (8 per device x 1 accumulation x " \
           "1 processes)" in line and "--gradient_accumulation_steps 2" in line and "--force_resume" in line
    assert not (tmp_path / "refused" / "final").exists()
    # Forced: the 32 samples left in epoch 1 are dealt 8 per step, so 4 steps follow step 6 instead of 2.
    out = tmp_path / "forced"
    out.mkdir()
    shutil.copy(ref / "metrics.jsonl", out)
    run_recipe(out, *no_dropout, *FLAGS, "--force_resume", "--resume_from_checkpoint",
               str(ref / "checkpoints" / f"step_{RESUME_STEP}"), config=None)
    steps = read_jsonl(out / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, RESUME_STEP + 5))
    assert [s["samples"] for s in steps[RESUME_STEP:]] == [8, 8, 8, 8]
    forced = [i for m in rank_records(out)[0]["sample_ids"] for i in m]
    assert rank_records(out)[0]["epochs"][0]["skipped_batches"] == 0  # another global batch: a sample position
    assert forced == torch.randperm(64, generator=torch.Generator().manual_seed(42 + 1)).tolist()[SAMPLES_AT_RESUME:]


def test_single_process_sampler_follows_the_epoch(reference):
    """Each epoch is its own permutation of (seed, epoch), also in one process (set_epoch reaches the sampler)."""
    ref = reference("ddp.yaml", 1)
    micro = rank_records(ref)[0]["sample_ids"]
    per_epoch = len(micro) // 2
    for epoch in (0, 1):
        seen = [i for m in micro[epoch * per_epoch:(epoch + 1) * per_epoch] for i in m]
        assert seen == torch.randperm(64, generator=torch.Generator().manual_seed(42 + epoch)).tolist()


def test_plan_counts_the_steps_left_from_a_sample_position():
    sampler = data.EvenShardBatchSampler(64, 8, 1, seed=42)
    sampler.resume_at(1, 32)
    plan = data.StepPlan.of(sampler, 2, epochs=2, max_steps=None, done_steps=6)
    assert (plan.total_steps, plan.epochs, plan.windows(1), plan.windows(0)) == (8, 2, [16, 16], [16] * 4)
    forced = data.StepPlan.of(sampler, 1, epochs=2, max_steps=None, done_steps=6)  # 8 per step: 4 steps left
    assert (forced.total_steps, forced.windows(1)) == (10, [8] * 4)
