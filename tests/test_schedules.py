"""Learning-rate schedules by name (recipes/training/schedule.py), warm-up as TrainingArguments reads it, and padding to
a multiple: flag errors, the rates a run records against transformers' own schedule, exact on resume on another world
size, and the padded lengths."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import TINY, losses, read_jsonl, run_recipe
from recipes import RecipeError, cls
from recipes.inputs import data
from recipes.training import schedule


def config(*flags):
    return cls.parse_config(["--model_name_or_path", str(TINY), *flags])


@pytest.mark.parametrize("flags,total,expected", [
    ([], 100, 6), ([], 8, 0),  # --warmup_ratio 0.06 by default, rounded down as before
    (["--warmup_steps", "5"], 100, 5), (["--warmup_steps", "0.1"], 100, 10),
    (["--warmup_steps", "0.015"], 100, 2),  # a fraction is rounded up (transformers 5.23 get_warmup_steps)
    (["--warmup_ratio", "0.25"], 8, 2), (["--warmup_steps", "0"], 8, 0)])
def test_warmup_steps_as_transformers_reads_them(tiny_model, flags, total, expected):
    from transformers import TrainingArguments

    assert schedule.warmup_steps(config(*flags), total) == expected
    if "--warmup_steps" in flags:
        value = float(flags[1])
        args = TrainingArguments(output_dir="unused", warmup_steps=value if value < 1 else int(value))
        assert args.get_warmup_steps(total) == expected


@pytest.mark.parametrize("flags,message", [
    (["--lr_scheduler_type", "reduce_lr_on_plateau"], "--lr_scheduler_type reduce_lr_on_plateau adapts to a metric"),
    (["--lr_scheduler_type", "greedy"], "--lr_scheduler_type greedy adapts to a metric"),
    (["--lr_scheduler_type", "cosine_annealing"], "--lr_scheduler_type cosine_annealing is not one of linear, cosine,"),
    (["--warmup_steps", "4", "--warmup_ratio", "0.1"], "--warmup_steps and --warmup_ratio both given"),
    (["--warmup_steps", "2.5"], "--warmup_steps 2.5 must be a whole number of steps >= 1 or a fraction in [0, 1)"),
    (["--warmup_steps", "-1"], "--warmup_steps -1.0 must be a whole number"),
    (["--warmup_ratio", "1.5"], "--warmup_ratio 1.5 must be between 0 and 1"),
    (["--lr_scheduler_kwargs", "{num_cycles: 2}"], "--lr_scheduler_kwargs is not JSON"),
    (["--lr_scheduler_kwargs", "[2]"], "--lr_scheduler_kwargs must be a JSON object"),
    (["--lr_scheduler_type", "cosine_with_min_lr"], "--lr_scheduler_type cosine_with_min_lr with --lr_scheduler_kwargs"
                                                    " {}: One of min_lr or min_lr_rate should be set"),
    (["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"cycles": 2}'], "unexpected keyword argument"),
    (["--pad_to_multiple_of", "0"], "--pad_to_multiple_of 0 must be >= 1"),
])
def test_bad_schedule_and_padding_flags_are_one_line(tiny_model, flags, message):
    with pytest.raises(RecipeError) as err:
        config(*flags)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_padding_beyond_the_positions_is_refused(tiny_model):
    from recipes.model import source

    # RoBERTa's 514 positions hold 512 tokens; 510 rounded up to a multiple of 64 is 512, to 128 it is 512, of 100 600
    source.check_model_source(config("--max_length", "510", "--pad_to_multiple_of", "64"))
    with pytest.raises(RecipeError, match="--pad_to_multiple_of 100 pads a batch of --max_length 510 tokens to 600, "
                                          "beyond the 512 positions .* use --max_length 500 or less"):
        source.check_model_source(config("--max_length", "510", "--pad_to_multiple_of", "100"))


@pytest.mark.parametrize("grouped", [False, True])
def test_batches_are_padded_to_the_multiple(tiny_model, grouped):
    from transformers import AutoTokenizer

    flags = ["--max_train_samples", "96", "--per_device_train_batch_size", "8", "--pad_to_multiple_of", "8"]
    cfg = config(*flags, *(["--group_by_length"] if grouped else []))
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    train_ds, eval_ds, _ = data.prepare_datasets(cfg, tokenizer)
    loaders = data.build_loaders(cfg, train_ds, eval_ds, tokenizer, world_size=1)
    real = 0
    for loader in (loaders.train, loaders.eval):
        for batch in loader:
            length = batch["input_ids"].shape[1]
            assert length % 8 == 0 and length - 8 < int(batch["attention_mask"].sum(1).max()) <= length
            real += int(batch["attention_mask"].sum()) if loader is loaders.train else 0
    assert real == sum(len(ids) for ids in train_ds["input_ids"])  # padding adds positions, never tokens


# 4 steps of 2 x 8 on a cosine schedule with a quarter of them warming up, a checkpoint at step 2.
RUN = ["--max_train_samples", "64", "--max_eval_samples", "16", "--per_device_train_batch_size", "8",
       "--max_train_steps", "4", "--lr_scheduler_type", "cosine", "--warmup_steps", "0.25",
       "--checkpointing_steps", "2", "--pad_to_multiple_of", "8"]


def test_named_schedule_runs_and_resumes_on_another_world_size(no_dropout_model, tmp_path):
    """Without dropout, so that one process computes what two did (test_elastic's rule)."""
    from transformers import get_scheduler

    ref = tmp_path / "ref"
    run = [*RUN, "--model_name_or_path", str(no_dropout_model)]
    run_recipe(ref, *run)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    expected_sched = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=4)
    expected = []
    for _ in range(4):
        expected.append(expected_sched.get_last_lr()[0])
        optimizer.step()
        expected_sched.step()
    records = read_jsonl(ref / "metrics.jsonl")
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-12)
    assert all(r["padded_tokens"] % 8 == 0 for r in records)
    resolved = json.loads((ref / "run_config.json").read_text())["config"]
    assert (resolved["lr_scheduler_type"], resolved["warmup_steps"], resolved["pad_to_multiple_of"]) == (
        "cosine", 0.25, 8)
    # the 2-process checkpoint of step 2, resumed on one process with the same global batch (16 x 1)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for name in ("metrics.jsonl", "eval.jsonl"):
        shutil.copy(ref / name, resumed)
    run_recipe(resumed, *run, "--per_device_train_batch_size", "16", "--resume_from_checkpoint",
               str(ref / "checkpoints" / "step_2"), config="single.yaml")
    got = read_jsonl(resumed / "metrics.jsonl")
    assert [r["lr"] for r in got] == [r["lr"] for r in records]
    assert losses(resumed)[2:] == pytest.approx(losses(ref)[2:], abs=1e-6)
