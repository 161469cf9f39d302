"""Exact resume, exact eval, exact accumulation: numbers compared between runs (tiny model, fp32, 2 processes).

Tolerances: DDP on CPU is deterministic, so a resumed DDP run must equal the uninterrupted one bit for bit
(tolerance 0). ZeRO-2 and FSDP restore the same fp32 state from their own checkpoint formats; they are held to the
same exact equality, and the test prints the max difference it saw.
"""
from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from helpers import fp32_launch_args, losses, rank_records, read_jsonl, run_recipe

pytestmark = pytest.mark.multiproc

# 200 examples, micro-batch 8 on 2 ranks: 13 micro-batches per epoch, the last one with 4 examples per rank.
# With accumulation 3 that is 5 optimizer steps per epoch, the 5th over a single micro-batch (a partial window).
BASE = ["--max_train_samples", "200", "--max_eval_samples", "16", "--per_device_train_batch_size", "8",
        "--num_train_epochs", "2", "--record_ranks"]
# A reference run saves only the steps resumed from (a save changes no number): DDP with accumulation 3 resumes from
# steps 5 and 6, the other accumulation 3 cases from step 6; the last step is always saved too.
CHECKPOINTS = {"ddp.yaml": ["--checkpointing_steps", "1"], "other": ["--checkpointing_steps", "6"]}
MICRO_PER_EPOCH = 13
# (resume step for accumulation 1, for accumulation 3): at the epoch boundary; mid-epoch 1 and again later in that
# epoch from the resumed run's own checkpoint. A resume in epoch 0 is the killed-rank test's (step 4, accumulation 1)
# and test_elastic's; epoch 1 also checks that the sampler's epoch is restored. DDP with accumulation 3 runs both
# scenarios (its windows include a partial one); DDP with accumulation 1 resumes at the epoch boundary, the one
# position where nothing is skipped (its mid-epoch resume is the killed-rank test's, from step 4). The
# ZeRO-2 and FSDP cases resume once, mid-epoch 1: the data position is the recipe's, the same for every strategy;
# what differs is the state each strategy saves and loads.
SCENARIOS = {"epoch_boundary": (13, 5), "twice_in_epoch_1": (15, 6)}
AT_EPOCH_BOUNDARY = {"epoch_boundary": (13, 5)}
ONCE_IN_EPOCH_1 = {"mid_epoch_1": (15, 6)}
SECOND_STOP = 8  # the second stop of twice_in_epoch_1 (accumulation 3): a checkpoint of the resumed run


def consumed(ref_dir, step: int) -> int:
    state = json.loads((ref_dir / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())
    return state["epoch"] * MICRO_PER_EPOCH + state["samples_in_epoch"] // 16  # mid-epoch: full rounds of 2 x 8


def assert_continues(ref_dir, resumed_dir, from_step: int, config: str):
    ref, got = losses(ref_dir), losses(resumed_dir)
    assert len(got) == len(ref) and got[:from_step] == ref[:from_step]  # records before the checkpoint are kept
    delta = max(abs(a - b) for a, b in zip(ref[from_step:], got[from_step:]))
    print(f"{config} from step {from_step}: max |loss diff| after resume = {delta:.3e}")
    assert got[from_step:] == ref[from_step:]
    skip = consumed(ref_dir, from_step)
    for r_ref, r_got in zip(rank_records(ref_dir), rank_records(resumed_dir)):
        assert r_got["sample_ids"] == r_ref["sample_ids"][skip:], "resumed run skipped or repeated samples"
        assert_skipped_with_accelerate(r_got["epochs"][0], skip % MICRO_PER_EPOCH)
    assert read_jsonl(resumed_dir / "eval.jsonl")[-1] == read_jsonl(ref_dir / "eval.jsonl")[-1]


def assert_skipped_with_accelerate(first_epoch: dict, micro_batches: int):
    """A mid-epoch resume skips the consumed micro-batches through `accelerator.skip_first_batches` (its loader's
    SkipBatchSampler, with that count); at an epoch boundary nothing is skipped."""
    if micro_batches:
        assert first_epoch["batch_sampler"] == "SkipBatchSampler" and first_epoch["skipped_batches"] == micro_batches
    else:
        assert first_epoch["skipped_batches"] == 0


# zero2_offload: DeepSpeed's CPU Adam steps instead of the recipe's AdamW, and a same-world load gave it new param
# groups that the linear schedule no longer reached (recipes/checkpoints/checkpoint.py schedule_stepping_groups).
CASES = [("ddp.yaml", 1), ("ddp.yaml", 3), ("zero2.yaml", 3), ("fsdp.yaml", 3), ("zero2_offload.yaml", 3)]


@pytest.fixture(scope="module")
def ddp_reference(tiny_model, tmp_path_factory):
    """The uninterrupted DDP run, accumulation 1, a checkpoint at each epoch's end (steps 13 and 26): the resume
    reference, the killed-rank reference and the source of the refusal test's checkpoint (each test copies what it
    changes)."""
    ref = tmp_path_factory.mktemp("ddp_ga1_ref")
    run_recipe(ref, *BASE, "--gradient_accumulation_steps", "1", "--checkpointing_steps", "epoch")
    return ref


@pytest.mark.parametrize("config,accum", CASES, ids=[f"{c[:-5]}-ga{a}" for c, a in CASES])
def test_resume_equals_uninterrupted_run(request, tmp_path, config, accum):
    flags = [*BASE, "--gradient_accumulation_steps", str(accum)]
    launch = fp32_launch_args(config, tmp_path)
    if (config, accum) == ("ddp.yaml", 1):  # ddp.yaml is fp32 already: the shared reference is this run
        ref = request.getfixturevalue("ddp_reference")
    else:
        request.getfixturevalue("tiny_model")
        ref = tmp_path / "ref"
        run_recipe(ref, *flags, *CHECKPOINTS.get(config, CHECKPOINTS["other"]), config=config, launch_args=launch)
    assert len(losses(ref)) == 2 * {1: 13, 3: 5}[accum]
    scenarios = ONCE_IN_EPOCH_1 if config != "ddp.yaml" else SCENARIOS if accum == 3 else AT_EPOCH_BOUNDARY
    for name, steps in scenarios.items():
        from_step = steps[0] if accum == 1 else steps[1]
        out = tmp_path / name
        out.mkdir()
        shutil.copy(ref / "metrics.jsonl", out)  # the interrupted run's records, to be truncated at the checkpoint
        shutil.copy(ref / "eval.jsonl", out)
        twice = name == "twice_in_epoch_1"
        saves = ["--checkpointing_steps", str(SECOND_STOP)] if twice else []  # the second stop's checkpoint
        run_recipe(out, *flags, *saves, "--resume_from_checkpoint", str(ref / "checkpoints" / f"step_{from_step}"),
                   config=config, launch_args=launch)
        assert_continues(ref, out, from_step, config)
        if twice:  # stop again, later in the same epoch, from the resumed run's checkpoint
            second = SECOND_STOP
            again = tmp_path / "again"
            shutil.copytree(out, again, ignore=shutil.ignore_patterns("ranks", "final"))
            run_recipe(again, *flags, "--resume_from_checkpoint", str(out / "checkpoints" / f"step_{second}"),
                       config=config, launch_args=launch)
            assert_continues(ref, again, second, config)


def test_resume_refuses_other_global_batch(ddp_reference, tmp_path):
    shutil.copytree(ddp_reference / "checkpoints" / "step_13", tmp_path / "checkpoints" / "step_13")
    (tmp_path / "checkpoints" / "latest").write_text("step_13\n")
    ckpt = str(tmp_path / "checkpoints" / "step_13")
    proc = run_recipe(tmp_path, *BASE, "--resume_from_checkpoint", ckpt, "--gradient_accumulation_steps", "3",
                      config=None, check=False)
    assert proc.returncode == 2
    assert "global batch 16 (8 per device x 1 accumulation x 2 processes) -> 24" in proc.stderr
    assert "--force_resume" in proc.stderr
    (tmp_path / "checkpoints" / "step_13" / "random_states_1.pkl").unlink()
    proc = run_recipe(tmp_path, *BASE, "--resume_from_checkpoint", "latest", config="ddp.yaml", check=False)
    assert proc.returncode != 0 and "no RNG state for rank 1" in proc.stderr


def test_killed_rank_fails_fast_and_resume_finishes_the_job(ddp_reference, tmp_path):
    flags = [*BASE, "--checkpointing_steps", "2"]
    ref = ddp_reference  # checkpointing changes no number: the same losses and eval as a run without it
    out = tmp_path / "killed"
    started = time.monotonic()
    proc = run_recipe(out, *flags, check=False, env={"CLS_FAULT": "step:5:1"})  # rank 1 SIGKILLed after step 5
    elapsed = time.monotonic() - started
    print(f"launcher exited {proc.returncode} {elapsed:.1f} s after start (watchdog timeout 120 s)")
    assert proc.returncode != 0 and elapsed < 100
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"

    # The resume is killed in turn, while rank 0 saves step 6: no step_6, `latest` still names step_4 and the
    # half-written step_6.tmp is left behind; resumed once more, the job ends exactly where the reference ends.
    proc = run_recipe(out, *flags, "--resume_from_checkpoint", "latest", check=False, env={"CLS_FAULT": "save:6:0"})
    assert proc.returncode != 0
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert not (out / "checkpoints" / "step_6").exists() and (out / "checkpoints" / "step_6.tmp").exists()
    run_recipe(out, *flags, "--resume_from_checkpoint", "latest")
    assert losses(out) == losses(ref)
    assert read_jsonl(out / "eval.jsonl")[-1] == read_jsonl(ref / "eval.jsonl")[-1]


# Eval exactness (every example index gathered exactly once for 101, 64, 20 and 1 examples on 2 ranks) is in
# tests/test_strength.py, in one launch; final/ re-evaluated in one process is in test_strategies.py.


# Accumulation equivalence tolerance: the same 64 (or, at the end, 8) samples per step, summed in another order
# (4 micro-batches of 8 vs 1 of 32) and padded to other lengths: float32 noise of ~1e-7 per step, through 4 Adam steps.
ACCUM_ATOL = 1e-5


@pytest.mark.parametrize("config", ["ddp.yaml", "zero2.yaml", "zero3.yaml"])
def test_accumulation_8x4_equals_32x1(no_dropout_model, tmp_path, config):
    from safetensors.torch import load_file

    runs = {}
    for micro, accum in ((8, 4), (32, 1)):
        out = tmp_path / f"b{micro}x{accum}"
        run_recipe(out, "--model_name_or_path", str(no_dropout_model), "--max_train_samples", "200",
                   "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(accum),
                   config=config, launch_args=fp32_launch_args(config, tmp_path))
        runs[(micro, accum)] = out
    # 200 samples: 3 steps of 64 and a last one of 8 (one partial window of a single micro-batch at 8 x 4).
    steps = [read_jsonl(out / "metrics.jsonl") for out in runs.values()]
    assert [s["samples"] for s in steps[0]] == [s["samples"] for s in steps[1]] == [64, 64, 64, 8]
    deltas = [abs(a["loss"] - b["loss"]) for a, b in zip(*steps)]
    weights = [load_file(out / "final" / "model.safetensors") for out in runs.values()]
    max_param = max((weights[0][k].float() - weights[1][k].float()).abs().max().item() for k in weights[0])
    print(f"{config}: 8x4 vs 32x1: max loss diff {max(deltas):.2e}, max param diff {max_param:.2e}")
    assert max(deltas) < ACCUM_ATOL and max_param < ACCUM_ATOL
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], atol=ACCUM_ATOL, rtol=0)
    # The pre-clip gradient norm of each step: a constant factor on the gradient (AdamW is nearly blind to it and
    # clipping rescales it) shows here; float32 noise of the other summation order is ~1e-7 relative.
    norms = [[s["grad_norm"] for s in run] for run in steps]
    print(f"{config}: grad norms 8x4 {norms[0]} vs 32x1 {norms[1]}")
    assert norms[0] == pytest.approx(norms[1], rel=ACCUM_ATOL, abs=0)
