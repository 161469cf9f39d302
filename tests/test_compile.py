"""--torch_compile (recipes/model/compilation.py): compiled runs train the eager run's losses, compile a bounded number
of graphs under dynamic padding, and record graphs, compile time and what was compiled; bad flag values are one line.

Most runs use the dropout-free tiny model, so that runs on other world sizes or micro-batches do the same arithmetic:
measured 1.7e-7 relative at most over 8 steps (one process, DDP, FSDP2 regional, ZeRO-2); the bound allows
LOSS_RTOL, far below what a real difference (a missed all-reduce, a wrong loss scale) moves (1e-3 and more). With
dropout, on CPU the compiled model draws its masks from torch's generator as eager does (inductor's fallback_random),
so one process compiled and eager with dropout agree as closely; with inductor's own generator they differed from
step 1 (1.3e-2 relative, measured when --torch_compile_rng was added, when a launch here showed it at every run; that
launch, a cold compile of 50 s, gave way to test_rng_flag_reaches_inductor, which holds the flag to inductor's setting).

The first compile of a graph costs 20-50 s on 2 busy CPU cores; later runs read inductor's cache
(/tmp/torchinductor_$USER) and compile in about 4 s. So the launches are few and shared by the tests.
"""
from __future__ import annotations

import json

import pytest

from helpers import fp32_launch_args, losses, no_gpu, read_jsonl, run_recipe
from recipes import RecipeError
from recipes.config import build_parser, parse_config

LOSS_RTOL = 1e-4
STEPS = ["--max_train_steps", "8", "--logging_steps", "1", "--report_to", "none"]


@pytest.fixture(scope="module")
def runs(tiny_model, no_dropout_model, tmp_path_factory) -> dict:
    """Eager on one process (the reference), compiled on one process, compiled under DDP (2 x 8 samples: the
    same 16 samples a step), all without dropout; eager and compiled on one process with the model's dropout 0.1;
    dynamic padding: each step's batch has its own length."""
    root, model = tmp_path_factory.mktemp("compile"), ["--model_name_or_path", str(no_dropout_model)]
    with_dropout = ["--model_name_or_path", str(tiny_model)]
    plans = {"eager": ([*model], "single.yaml"), "compiled": ([*model, "--torch_compile"], "single.yaml"),
             "ddp": ([*model, "--torch_compile", "--per_device_train_batch_size", "8"], "ddp.yaml"),
             "eager_dropout": (with_dropout, "single.yaml"),
             "compiled_dropout": ([*with_dropout, "--torch_compile"], "single.yaml")}
    for name, (flags, config) in plans.items():
        run_recipe(root / name, *STEPS, *flags, config=config)
    return {name: root / name for name in plans}


def assert_same_losses(out, reference) -> float:
    got, want = losses(out), losses(reference)
    assert len(got) == len(want) == 8
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"{out.name}: max relative loss difference {worst:.2e}")
    assert worst < LOSS_RTOL
    return worst


def assert_bounded_graphs(out, train_graphs: int) -> None:
    """`train_graphs` graphs by the first step and none after it, whatever the lengths; one set more for evaluation;
    the compile time in the records, apart from the steps' own time."""
    steps = read_jsonl(out / "metrics.jsonl")
    assert len({s["padded_tokens"] // s["samples"] for s in steps}) > 3  # many lengths: the bound means something
    assert [s["graphs"] for s in steps] == [train_graphs] * 8
    assert steps[0]["compile_s"] > 0 and len({s["compile_s"] for s in steps}) == 1
    assert steps[1]["elapsed"] - steps[0]["elapsed"] < steps[0]["compile_s"]  # step 1 paid the compile, not step 2
    assert read_jsonl(out / "eval.jsonl")[-1]["graphs"] == 2 * train_graphs  # eval mode, no_grad: its own graphs


def test_compiled_run_trains_the_eager_losses_in_one_graph(runs):
    assert_same_losses(runs["compiled"], runs["eager"])
    assert_bounded_graphs(runs["compiled"], train_graphs=1)
    compiled = json.loads((runs["compiled"] / "run_config.json").read_text())
    assert compiled["config"]["torch_compile"] is True
    assert compiled["compile"] == {"backend": "inductor", "mode": "default", "source": "--torch_compile",
                                   "regions": "whole model", "dynamic_dims": ["batch", "length"],
                                   "by": "accelerator.prepare",
                                   "random": "torch's generator (inductor fallback_random)"}
    from safetensors import safe_open

    with safe_open(runs["compiled"] / "final" / "model.safetensors", "pt") as f:  # the plain model's names
        assert not [key for key in f.keys() if "_orig_mod" in key] and "classifier.dense.weight" in f.keys()
    eager = json.loads((runs["eager"] / "run_config.json").read_text())
    assert eager["compile"] is None and "graphs" not in read_jsonl(runs["eager"] / "metrics.jsonl")[0]


@no_gpu
def test_compiled_dropout_draws_the_eager_masks_on_cpu(runs):
    """With dropout the compiled run trains the eager run's losses step for step: the same masks, from torch's
    generator; and the masks matter here (the losses leave the dropout-free run's from step 1)."""
    assert_same_losses(runs["compiled_dropout"], runs["eager_dropout"])
    assert abs(losses(runs["eager_dropout"])[0] - losses(runs["eager"])[0]) > 1e-3
    assert_bounded_graphs(runs["compiled_dropout"], train_graphs=1)
    record = json.loads((runs["compiled_dropout"] / "run_config.json").read_text())["compile"]["random"]
    assert record == "torch's generator (inductor fallback_random)"


@pytest.mark.parametrize("rng,device,generator", [("auto", "cpu", True), ("auto", "cuda", False),
                                                  ("torch", "cuda", True), ("inductor", "cpu", False)])
def test_rng_flag_reaches_inductor(tiny_model, rng, device, generator):
    """--torch_compile_rng sets inductor's fallback_random (read when the first call compiles) before the model is
    called, whatever an earlier setting was, and run_config.json's record names the generator: torch's on CPU by
    default and with `torch`, inductor's on GPUs by default and with `inductor`."""
    import types

    import torch
    import torch._inductor.config
    from accelerate.utils import TorchDynamoPlugin

    from recipes.model import compilation

    cfg = parse_config(["--model_name_or_path", str(tiny_model), "--torch_compile", "--torch_compile_rng", rng])
    accelerator = types.SimpleNamespace(device=torch.device(device), state=types.SimpleNamespace(
        dynamo_plugin=TorchDynamoPlugin(backend="inductor"), deepspeed_plugin=None))
    with torch._inductor.config.patch(fallback_random=not generator):  # restored after the block
        compilation.CompileWatch(cfg, accelerator, torch.nn.Linear(1, 1))
        assert torch._inductor.config.fallback_random is generator
    assert compilation.describe(cfg, accelerator)["random"] == (
        "torch's generator (inductor fallback_random)" if generator else "inductor's generator")


@pytest.mark.multiproc
@no_gpu
def test_ddp_compiled_trains_the_eager_losses(runs):
    assert_same_losses(runs["ddp"], runs["eager"])
    assert_bounded_graphs(runs["ddp"], train_graphs=1)  # one bucket on the tiny model: DDPOptimizer splits nothing
    assert json.loads((runs["ddp"] / "run_config.json").read_text())["distributed_type"] == "MULTI_CPU"


@pytest.mark.multiproc
@no_gpu
def test_fsdp2_compiles_each_layer(runs, no_dropout_model, tmp_path):
    out = tmp_path / "fsdp"
    run_recipe(out, "--model_name_or_path", str(no_dropout_model), *STEPS, "--torch_compile", "--compile_regions",
               "--per_device_train_batch_size", "8", config="fsdp.yaml", launch_args=fp32_launch_args("fsdp.yaml",
                                                                                                     tmp_path))
    assert_same_losses(out, runs["eager"])
    # a graph per compiled region (the layers share one), 4 in all here, each compiled once: no graph per length
    assert_bounded_graphs(out, train_graphs=4)
    assert json.loads((out / "run_config.json").read_text())["compile"]["regions"] == "encoder layers"


@pytest.mark.multiproc
@no_gpu
def test_zero2_compiles_through_deepspeed(runs, no_dropout_model, tmp_path):
    """Accelerate 1.15.0 hands the engine to DeepSpeedEngine.compile (deepspeed 0.19.8), which runs on CPU too."""
    out = tmp_path / "zero2"
    run_recipe(out, "--model_name_or_path", str(no_dropout_model), *STEPS, "--torch_compile",
               "--per_device_train_batch_size", "8", config="zero2.yaml",
               launch_args=fp32_launch_args("zero2.yaml", tmp_path))
    assert_same_losses(out, runs["eager"])
    assert_bounded_graphs(out, train_graphs=1)
    assert json.loads((out / "run_config.json").read_text())["compile"]["by"] == "DeepSpeedEngine.compile"


@pytest.mark.parametrize("flags,message", [
    (["--torch_compile", "--torch_compile_mode", "fast"], "unknown --torch_compile_mode 'fast' (one of default, "),
    (["--compile_regions"], "--torch_compile_mode and --compile_regions go with --torch_compile"),
    (["--torch_compile_mode", "max-autotune"], "--torch_compile_mode and --compile_regions go with --torch_compile"),
    (["--torch_compile", "--data_parallel"], "--torch_compile with --data_parallel: nn.DataParallel's replicas"),
    (["--torch_compile", "--torch_compile_rng", "philox"], "unknown --torch_compile_rng 'philox' (one of auto, torch, "),
    (["--torch_compile_rng", "torch"], "--torch_compile_rng goes with --torch_compile"),
])
def test_bad_values_are_one_line(tiny_model, flags, message):
    with pytest.raises(RecipeError) as err:
        parse_config(["--model_name_or_path", str(tiny_model), *flags])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fsdp_whole_model_compile_is_refused(tiny_model, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` sets for an FSDP config
    with pytest.raises(RecipeError, match=r"^--torch_compile under FSDP needs --compile_regions: [^\n]+$"):
        parse_config(["--model_name_or_path", str(tiny_model), "--torch_compile"])
    parse_config(["--model_name_or_path", str(tiny_model), "--torch_compile", "--compile_regions"])


def test_flags_are_in_help():
    text = build_parser().format_help()
    assert all(f"--{name}" in text for name in ("torch_compile", "torch_compile_mode", "compile_regions",
                                                "torch_compile_rng"))


def test_bench_times_only_steps_that_compiled_nothing():
    """scripts/measure/bench_compile.py: a step whose graph count grew is compile time, left out of the step time; the
    ratio is taken within a round."""
    from scripts.measure.bench_compile import compile_ratios, timing

    steps = [{"elapsed": e, "tokens": 100, "padded_tokens": 128, "graphs": g, "compile_s": 9.0}
             for e, g in ((10.0, 1), (11.0, 1), (12.0, 1), (22.0, 2), (23.0, 2), (24.0, 2), (28.0, 2))]
    t = timing(steps, warmup_steps=1)
    # not step 4 (it compiled: 10 s); the 4 s stall of step 7 moves the median step, not the throughput
    assert t["timed_steps"] == 5 and t["step_time_s"] == 1.0 and t["tokens_per_s"] == 100.0
    assert t["positions_per_s"] == 128.0  # the positions computed, padding included: MFU's basis
    assert t["train_graphs"] == 2 and t["compile_s"] == 9.0
    rows = [{"model": "tiny", "dropout": "none", "side": side, "round": r, "status": "ok", "step_time_s": s,
             "graphs": 2, "train_graphs": 1, "compile_s": 4.0, "mfu": 0.5, "losses": [1.0, loss]}
            for side, r, s, loss in (("eager", 0, 1.0, 1.0), ("compiled", 0, 0.8, 1.00001), ("eager", 1, 2.0, 1.0),
                                     ("compiled", 1, 2.0, 1.0))]
    rows += [{**rows[0], "side": "loop", "round": r, "step_time_s": s, "mfu": 0.4} for r, s in ((0, 1.1), (1, 1.8))]
    ratios = compile_ratios(rows)
    compiled, loop = ratios["tiny dropout none"], ratios["tiny dropout none, recipe eager against the plain loop"]
    assert compiled["speedup"] == {"median": 1.125, "min": 1.0, "max": 1.25, "rounds": 2}
    assert compiled["max_loss_rel_diff"] == pytest.approx(1e-5) and compiled["label"] == "compiled / eager"
    # the loop's step time over the recipe's: 1.1 / 1.0 and 1.8 / 2.0
    assert loop["speedup"] == {"median": 1.0, "min": 0.9, "max": 1.1, "rounds": 2} and loop["label"] == "recipe / loop"
    assert loop["mfu"] == {"eager": {"median": 0.5, "min": 0.5, "max": 0.5, "rounds": 2},
                           "loop": {"median": 0.4, "min": 0.4, "max": 0.4, "rounds": 2}}


def test_bench_runs_only_the_chosen_pair_in_its_own_results_file(monkeypatch, tmp_path):
    """scripts/measure/bench_compile.py --models/--dropout/--sides/--rounds/--tag: the chosen sides of the chosen pair
    in interleaved rounds (E L, L E, ...), written to results/<date>_compile-<tag>_..., never over the whole bench's."""
    import dataclasses

    from scripts.measure import bench, bench_compile

    calls = []

    def one_run(work, model, dropout, side, round_, runs_dir, timeout):
        calls.append((work.name, dropout, side, round_))
        return {"model": work.name, "dropout": dropout, "side": side, "round": round_, "status": "ok",
                "step_time_s": 1.0 if side == "eager" else 1.1, "tokens_per_s": 1.0, "mfu": 0.5, "matmul_flops": 1e9,
                "graphs": 0, "train_graphs": 0, "compile_s": 0.0, "losses": [1.0]}

    monkeypatch.setattr(bench_compile, "one_run", one_run)
    monkeypatch.setattr(bench_compile, "without_dropout", lambda work, runs_dir: "copy")
    profile = dataclasses.replace(bench.PROFILES["compile"], repeats=3)
    results = bench_compile.run(profile, tmp_path, tmp_path, "cmd", log=lambda line: None, tag="loop",
                                only={"models": ["roberta-base"], "dropout": ["none"], "sides": ["eager", "loop"]})
    assert calls == [("roberta-base", "none", side, r) for r, sides in enumerate(
        (("eager", "loop"), ("loop", "eager"), ("eager", "loop"))) for side in sides]
    entry = results["ratios"]["roberta-base dropout none, recipe eager against the plain loop"]
    assert list(results["ratios"]) == ["roberta-base dropout none, recipe eager against the plain loop"]
    assert entry["speedup"]["median"] == pytest.approx(1.1) and entry["speedup"]["rounds"] == 3
    assert [p.name for p in tmp_path.glob("*compile*")] and all(
        p.name.split("_")[1] == "compile-loop" for p in tmp_path.glob("*.json"))
    with pytest.raises(SystemExit):  # a partial run without its own file name
        bench_compile.main(["--sides", "eager", "loop"])
