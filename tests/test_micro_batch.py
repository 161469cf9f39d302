"""--auto_micro_batch: the micro-batch that fits, the same training (issue 26 item 4).

The recipe is launched tiny on 2 CPU processes with `--per_device_train_batch_size 8 --gradient_accumulation_steps 1
--auto_micro_batch` and an out-of-memory error injected on rank 1 for trial micro-batches above 4 (CLS_FAULT=oom:4:1):
it must choose 4 x 2, record it, and train as the run started with 4 x 2 does.

Tolerances: the DDP run that chose 4 x 2 and the DDP run started at 4 x 2 take the same code path on one machine,
with dropout on (the trial puts the RNG states back), so their losses are held equal (difference 0), as is the resumed
run to the uninterrupted one (DDP resume is exact: tests/test_resume.py). ZeRO-2 is compared with the DDP reference
under test_strategies' parity bounds (another reduction order: 5e-7 on the losses, 1e-5 relative on the norms).
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import fp32_launch_args, losses, no_gpu, read_jsonl, run_recipe
from recipes import RecipeError
from recipes.checkpoints.checkpoint import ResumePoint
from recipes.config import parse_config
from recipes.testing.probe import Probe
from recipes.training import micro_batch

# 64 samples, 2 ranks, 16 samples per optimizer step: 4 steps; short texts and a short trial.
SMALL = ["--max_train_samples", "64", "--max_eval_samples", "16", "--max_length", "64"]
ASKED = [*SMALL, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--auto_micro_batch"]
OOM_ABOVE_4_ON_RANK_1 = {"CLS_FAULT": "oom:4:1"}
PARITY_ATOL, GRAD_NORM_RTOL = 5e-7, 1e-5  # ZeRO-2 vs DDP, fp32 (tests/test_strategies.py)


def grad_norms(out: Path) -> list[float]:
    return [r["grad_norm"] for r in read_jsonl(out / "metrics.jsonl")]


def chosen(out: Path) -> dict:
    return json.loads((out / "run_config.json").read_text())["auto_micro_batch"]


@pytest.fixture(scope="module")
def started_at_4x2(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref_4x2")
    run_recipe(out, *SMALL, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
    return out


@pytest.fixture(scope="module")
def auto_ddp(tiny_model, tmp_path_factory):
    """Asked 8 x 1, rank 1 out of memory above 4; a checkpoint every 2 steps for the resume test."""
    out = tmp_path_factory.mktemp("auto_ddp")
    run_recipe(out, *ASKED, "--checkpointing_steps", "2", env=OOM_ABOVE_4_ON_RANK_1)
    return out


@pytest.mark.multiproc
@no_gpu  # the trial runs on CPU
def test_ddp_chooses_4x2_and_trains_as_the_run_started_at_4x2(auto_ddp, started_at_4x2):
    record = chosen(auto_ddp)
    assert record == {"asked_micro_batch": 8, "asked_accumulation": 1, "micro_batch": 4,
                      "gradient_accumulation_steps": 2, "candidates": [8, 4, 2, 1], "sequence_length": 64,
                      "source": "search",
                      "trials": [[{"micro_batch": 8, "fits": True}],  # rank 0: 8 fits; rank 1 failed at 8
                                 [{"micro_batch": 8, "fits": False}, {"micro_batch": 4, "fits": True}]]}
    resolved = json.loads((auto_ddp / "run_config.json").read_text())
    assert resolved["gradient_accumulation_steps"] == 2 and resolved["effective_batch_size"] == 16
    assert resolved["config"]["per_device_train_batch_size"] == 4
    state = json.loads((auto_ddp / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert (state["per_device_train_batch_size"], state["gradient_accumulation_steps"]) == (4, 2)
    ref, got = losses(started_at_4x2), losses(auto_ddp)
    print(f"ddp auto vs 4x2: max |loss diff| {max(abs(a - b) for a, b in zip(ref, got)):.3e} over {len(ref)} steps")
    assert len(got) == 4 and got == ref
    assert grad_norms(auto_ddp) == grad_norms(started_at_4x2)
    assert [r["samples"] for r in read_jsonl(auto_ddp / "metrics.jsonl")] == [16] * 4


@pytest.mark.multiproc
@no_gpu
def test_resume_keeps_the_checkpoints_choice(auto_ddp, tmp_path):
    """Resumed at step 2 with nothing injected: a new search would take 8 x 1; the run keeps 4 x 2 from the
    checkpoint and continues the uninterrupted run exactly."""
    for name in ("metrics.jsonl", "eval.jsonl"):  # the interrupted run's records, truncated at the checkpoint
        shutil.copy(auto_ddp / name, tmp_path)
    run_recipe(tmp_path, *ASKED, "--resume_from_checkpoint", str(auto_ddp / "checkpoints" / "step_2"))
    record = chosen(tmp_path)
    assert (record["micro_batch"], record["gradient_accumulation_steps"], record["source"]) == (4, 2, "checkpoint")
    assert record["trials"] == []
    assert losses(tmp_path) == losses(auto_ddp) and grad_norms(tmp_path) == grad_norms(auto_ddp)
    assert read_jsonl(tmp_path / "eval.jsonl")[-1] == read_jsonl(auto_ddp / "eval.jsonl")[-1]


@pytest.mark.multiproc
@no_gpu
def test_zero2_builds_deepspeeds_sizes_from_the_choice(started_at_4x2, tmp_path):
    run_recipe(tmp_path / "run", *ASKED, config="zero2.yaml", launch_args=fp32_launch_args("zero2.yaml", tmp_path),
               env=OOM_ABOVE_4_ON_RANK_1)
    record = chosen(tmp_path / "run")
    assert (record["micro_batch"], record["gradient_accumulation_steps"]) == (4, 2)
    assert record["deepspeed"] == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                                   "train_batch_size": 16}
    ref, got = losses(started_at_4x2), losses(tmp_path / "run")
    delta = max(abs(a - b) for a, b in zip(ref, got))
    print(f"zero2 auto vs ddp 4x2: max |loss diff| {delta:.3e}")
    assert len(got) == len(ref) == 4 and delta <= PARITY_ATOL
    assert grad_norms(tmp_path / "run") == pytest.approx(grad_norms(started_at_4x2), rel=GRAD_NORM_RTOL, abs=0)


@pytest.mark.parametrize("micro,accum,sizes", [(8, 1, [8, 4, 2, 1]), (6, 2, [6, 4, 3, 2, 1]), (4, 3, [4, 3, 2, 1]),
                                               (1, 5, [1]), (5, 1, [5, 1])])
def test_candidates_divide_the_samples_per_rank_and_never_exceed_the_asked_micro_batch(micro, accum, sizes):
    assert micro_batch.candidates(micro, accum) == sizes


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2)  # in eval mode


def test_trial_keeps_the_asked_size_without_oom_and_leaves_model_and_rng_as_they_were(model):
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cpu = torch.device("cpu")
    def trials(sizes, fault=None):  # the test probe observing the trials, as a --record_ranks/CLS_FAULT run has it
        with Probe(False, 0, fault=fault).installed():
            return micro_batch.largest_fitting(model, sizes, 16, cpu)

    assert trials([8, 4, 2, 1]) == [(8, True)]
    assert trials([8, 4, 2, 1], "oom:2:0") == [(8, False), (4, False), (2, True)]
    assert trials([8, 4], "oom:2:1") == [(8, True)]
    assert trials([2, 1], "oom:0:0") == [(2, False), (1, False)]
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and not model.training
    assert all(p.grad is None for p in model.parameters())


class Failing(torch.nn.Module):
    config = SimpleNamespace(pad_token_id=1, vocab_size=10)

    def __init__(self, message: str):
        super().__init__()
        self.weight, self.message = torch.nn.Parameter(torch.ones(1)), message

    def forward(self, input_ids, attention_mask):
        raise RuntimeError(self.message)


def test_only_out_of_memory_counts_as_not_fitting():
    cpu = torch.device("cpu")
    cpu_oom = f"[enforce fail at alloc_cpu.cpp:121] {micro_batch.CPU_OUT_OF_MEMORY} 123 bytes."
    assert micro_batch.largest_fitting(Failing(cpu_oom), [2, 1], 8, cpu) == [(2, False), (1, False)]
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"):
        micro_batch.largest_fitting(Failing("mat1 and mat2 shapes cannot be multiplied"), [2, 1], 8, cpu)


def test_resume_keeps_the_split_only_for_the_same_world_and_global_batch():
    start = ResumePoint(step=2, path=Path("ckpt"), world_size=2, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2)  # a global batch of 16
    assert micro_batch.kept_from_checkpoint(start, [8, 4, 2, 1], 8, 2) == 4
    assert micro_batch.kept_from_checkpoint(start, [8, 4, 2, 1], 4, 4) == 0  # another world size: search again
    assert micro_batch.kept_from_checkpoint(start, [8, 4, 2, 1], 16, 2) == 0  # another global batch
    assert micro_batch.kept_from_checkpoint(start, [2, 1], 8, 2) == 0  # above the asked micro-batch
    assert micro_batch.kept_from_checkpoint(ResumePoint(), [8, 4, 2, 1], 8, 2) == 0  # a fresh start


def test_flag_in_help_and_bad_combinations_refused(tiny_model, tmp_path):
    from recipes.config import build_parser

    assert "--auto_micro_batch" in build_parser().format_help()
    with pytest.raises(RecipeError, match="--auto_micro_batch .* not with --do_train false"):
        parse_config(["--auto_micro_batch", "--do_train", "false", "--predict_file", __file__])
    proc = run_recipe(tmp_path, "--auto_micro_batch", "--data_parallel", config=None, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and [line for line in lines if line.startswith("error:")] == [lines[-1]]
    assert "--auto_micro_batch" in lines[-1] and "--data_parallel" in lines[-1], lines[-1]


def one_process():
    """A config and the parts of an Accelerator that `fit` uses, for one process on CPU."""
    cfg = parse_config(["--auto_micro_batch", "--per_device_train_batch_size", "8", "--max_length", "12",
                        "--pad_to_multiple_of", "8"])
    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"), autocast=contextlib.nullcontext,
                                  print=print, gradient_accumulation_steps=1)
    return cfg, accelerator


def test_fit_sets_the_split_on_cfg_and_accelerator_in_one_process(model):
    cfg, accelerator = one_process()
    with Probe(False, 0, fault="oom:2:0").installed():
        record = micro_batch.fit(cfg, accelerator, model, ResumePoint())
    assert (cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps) == (2, 4)
    assert accelerator.gradient_accumulation_steps == 4
    assert record["sequence_length"] == 16 and record["trials"] == [[
        {"micro_batch": 8, "fits": False}, {"micro_batch": 4, "fits": False}, {"micro_batch": 2, "fits": True}]]
    cfg, accelerator = one_process()
    with pytest.raises(RecipeError, match="a micro-batch of 1 x 16 tokens runs out of memory on rank.s. 0"):
        with Probe(False, 0, fault="oom:0:0").installed():
            micro_batch.fit(cfg, accelerator, model, ResumePoint())
    with pytest.raises(RecipeError, match="cpu_ram_efficient_loading"):
        micro_batch.fit(cfg, accelerator, torch.nn.Linear(2, 2, device="meta"), ResumePoint())
    cfg.auto_micro_batch = False
    assert micro_batch.fit(cfg, accelerator, model, ResumePoint()) is None
