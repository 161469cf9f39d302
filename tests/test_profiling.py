"""--profile_steps A-B (recipes/outputs/profiling.py): the traces hold steps A..B and nothing else, on DDP and ZeRO-2;
bad values are one RecipeError line."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from helpers import TINY, fp32_launch_args, run_recipe
from recipes import RecipeError
from recipes.config import parse_config
from recipes.outputs.profiling import StepProfiler

FORWARD, OPTIMIZER = "aten::addmm", "Optimizer.step#AdamW.step"  # a Linear's forward; torch's AdamW.step range


def trace_events(path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def step_marks(events) -> dict[str, dict]:
    return {e["name"]: e for e in events if e["name"].startswith("optimizer_step_")}


def inside(event, mark) -> bool:
    return mark["ts"] <= event["ts"] and event["ts"] + event.get("dur", 0) <= mark["ts"] + mark["dur"]


def counts_per_step(events, marks) -> dict[str, Counter]:
    """Per step marker, how many forward, backward and optimizer events lie inside it; "outside": those in none."""
    kinds = {FORWARD: "forward", "AddmmBackward0": "backward", OPTIMIZER: "optimizer"}
    result = {name: Counter() for name in [*marks, "outside"]}
    for event in events:
        if event["name"] in kinds:
            where = next((name for name, mark in marks.items() if inside(event, mark)), "outside")
            result[where][kinds[event["name"]]] += 1
    return result


@pytest.fixture(scope="module")
def linears_per_forward(tiny_model) -> int:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(TINY, num_labels=2)
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())  # each one aten::addmm per forward


def check_rank_traces(out, steps: list[int], micro_batches: int, linears: int, optimizer_calls: int) -> None:
    for rank in (0, 1):
        assert len(list((out / "profile" / "tensorboard").glob(f"rank{rank}.*.pt.trace.json"))) == 1
        events = trace_events(out / "profile" / f"trace_rank{rank}.json")
        marks = step_marks(events)
        assert sorted(marks) == [f"optimizer_step_{s}" for s in steps]
        per_step = counts_per_step(events, marks)
        # Every Linear of every micro-batch of the profiled steps, its backward too, and nothing of the steps before
        # and after (their forwards would add `linears` each, inside no marker).
        expected = Counter(forward=micro_batches * linears, backward=micro_batches * linears,
                           optimizer=optimizer_calls)
        assert per_step == {**{f"optimizer_step_{s}": expected for s in steps}, "outside": Counter()}


@pytest.mark.multiproc
def test_ddp_traces_hold_steps_2_and_3(tmp_path, linears_per_forward):
    out = tmp_path / "ddp"
    run_recipe(out, "--max_train_steps", "5", "--gradient_accumulation_steps", "2", "--profile_steps", "2-3")
    assert json.loads((out / "run_config.json").read_text())["config"]["profile_steps"] == "2-3"
    check_rank_traces(out, [2, 3], micro_batches=2, linears=linears_per_forward, optimizer_calls=1)
    ddp_forwards = Counter(e["name"] for e in trace_events(out / "profile" / "trace_rank0.json"))
    assert ddp_forwards["DistributedDataParallel.forward"] == 4  # 2 steps x 2 micro-batches


@pytest.mark.multiproc
def test_zero2_trace_holds_step_2(tmp_path, linears_per_forward):
    out = tmp_path / "zero2"
    run_recipe(out, "--max_train_steps", "3", "--profile_steps", "2-2", config="zero2.yaml",
               launch_args=fp32_launch_args("zero2.yaml", tmp_path))
    # DeepSpeed 0.19.8's ZeRO-1/2 optimizer steps the wrapped AdamW once per parameter group (decay, no decay), from
    # inside the engine's backward of the step's last micro-batch.
    check_rank_traces(out, [2], micro_batches=1, linears=linears_per_forward, optimizer_calls=2)


@pytest.mark.parametrize("value,message", [
    ("3-2", "--profile_steps '3-2' must be A-B with 1 <= A <= B"),
    ("0-2", "--profile_steps '0-2' must be A-B"),
    ("2", "--profile_steps '2' must be A-B"),
    ("2-3-4", "--profile_steps '2-3-4' must be A-B"),
    ("a-b", "--profile_steps 'a-b' must be A-B"),
    ("2-", "--profile_steps '2-' must be A-B"),
])
def test_bad_values_are_one_line(tiny_model, value, message):
    with pytest.raises(RecipeError) as err:
        parse_config(["--model_name_or_path", str(tiny_model), "--profile_steps", value])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_steps_beyond_the_run_are_refused(tiny_model, tmp_path):
    with pytest.raises(RecipeError, match=r"^--profile_steps 4-6 goes beyond the run's 5 optimizer steps$"):
        parse_config(["--model_name_or_path", str(tiny_model), "--max_train_steps", "5", "--profile_steps", "4-6"])
    parse_config(["--model_name_or_path", str(tiny_model), "--max_train_steps", "5", "--profile_steps", "5-5"])
    # without --max_train_steps the count is known once the data are planned: the loop's profiler refuses it then
    with pytest.raises(RecipeError, match=r"^--profile_steps 4-6 goes beyond the run's 3 optimizer steps$"):
        StepProfiler("4-6", tmp_path, rank=0, total_steps=3)


def test_only_the_chosen_steps_are_recorded(tmp_path):
    """A loop as cls.py's (2 micro-batches a step), each step's matmul of its own width: only steps 2..4 appear."""
    profiler, weight = StepProfiler("2-4", tmp_path, rank=3, total_steps=6), torch.ones(4, 5, requires_grad=True)
    done = 0
    for micro in range(12):
        profiler.batch(done)
        (torch.ones(10 * (done + 1), 4) @ weight).sum().backward()  # step n multiplies 10 n rows
        if micro % 2 == 1:
            done += 1
            profiler.step(done)
    profiler.finish()  # after step 4 it has stopped already: nothing more
    events = trace_events(tmp_path / "trace_rank3.json")
    assert sorted(step_marks(events)) == ["optimizer_step_2", "optimizer_step_3", "optimizer_step_4"]
    dims = [e["args"]["Input Dims"] for e in events if e["name"] == "aten::mm"]
    # the forwards, (rows, 4) @ (4, 5), 2 micro-batches a step; each backward's weight gradient, (4, rows) @ (rows, 5)
    assert sorted(d[0][0] for d in dims if d[1] == [4, 5]) == [20, 20, 30, 30, 40, 40]
    assert sorted(d[0][1] for d in dims if d[1] != [4, 5]) == [20, 20, 30, 30, 40, 40]
    assert len(list((tmp_path / "tensorboard").glob("rank3.*.pt.trace.json"))) == 1
