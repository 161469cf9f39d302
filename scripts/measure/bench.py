"""Every strategy side by side on the same work, against the baselines users would pick instead.

    make bench                 # quick: the tiny model in fp32, every strategy + baselines (but unfused, eager_attn)
    make bench BENCH=full      # + roberta-base and roberta-large shapes (random init) in bf16, and every baseline
    make bench BENCH=compile   # torch.compile vs eager, tiny and roberta-base shape, fp32: measure/bench_compile.py

Each run trains the same data, seed, number of optimizer steps and effective batch; throughput counts the steps after
a warm-up, from the recipe's metrics.jsonl (elapsed, samples, tokens). Runs go to runs/bench/<model>_<run>; the
results to results/<date>_<device>_<host>.{md,json,png} (-2, -3, ... after a day's first), and docs/benchmark.md's
block between the bench markers (README.md quotes three headline ratios of it; tests/test_docs.py holds them to the
latest results file).

Runs per model: the recipe under each shipped strategy config (multi-process ones on every GPU, or 2 CPU processes),
`python recipes/cls.py --data_parallel` where more than one GPU is visible, and nine baselines on one process:
a hand-written PyTorch loop and transformers.Trainer (scripts/measure/bench_baselines.py, with the recipe's fused
AdamW), the recipe padding every batch to 128 tokens (--pad_to_max_length) instead of to the longest sequence, the
recipe with length-grouped batches (--group_by_length), without padding (`padding_free`, --padding_free: each
micro-batch packed into one row) and both (`padding_free_grouped`), and the recipe with torch's per-parameter AdamW
(`unfused`, --optim adamw_torch) or eager attention (`eager_attn`) instead of its defaults (recipes/model/kernels.py;
BENCH=full only: QUICK_BASELINES), the recipe training LoRA adapters of rank 8 and the head on the frozen model (`lora`,
--use_peft: its model state and speed beside full fine-tuning's; skipped for a model built from random init, or without
the lora extra); and `alternate`, the recipe, the loop and Trainer in three threads of one process, taking turns every 5
optimizer steps (scripts/measure/bench_baselines.py alternate), the basis of the overhead ratios. A launch that fails is
reported with its error and skipped.

The one-process runs that the ratios compare (COMPARED) run in interleaved rounds, A B C D E, E D C B A, ..., round r
with seed 42 + r, so that a change of load on the machine hits every side alike; each ratio is taken within a round
(the same seed, so the same samples), and reported as the median over the rounds with its min-max and the median's
95% bootstrap interval (scripts/measure/bench_report.py median_interval); the quick profile runs the HEADLINE ones in 4
more rounds by themselves (8 in all), where over 4 the interval is the rounds' min-max. Every run gets the whole
machine: on CPU each process gets cores / processes threads (OMP_NUM_THREADS, and --cpu_threads for the recipe),
recorded as `threads`.

A bench that knows when it was disturbed (scripts/measure/bench_load.py): every launch records its CPU share, the CPU
seconds of its processes / (wall seconds x threads per process x processes), over the whole launch, and others' share,
the machine's busy CPU (/proc/stat, steal included) less the run's own, over the machine's CPU, at its worst over any
stretch as long as the run's timed epoch. A run is disturbed when others' share exceeds 0.10 of the machine or its CPU
share falls below 0.85 x the best share of the same run (model and name) in this bench, the calibration: what an
undisturbed run of that kind reaches here today (multi-process runs wait in collectives, so each kind has its own).
A disturbed COMPARED run is launched again (same round and seed, runs/bench/<model>_<run>_r<round>_a<attempt>), at
most 2 more times; the replaced attempts stay in the results as `repeated`, and a last attempt still disturbed is set
aside: every time ratio leaves out the rounds where either side is set aside (where that is every round, it keeps
them all and says it is not to be trusted). The `alternate` run records its process's CPU and the machine's over each
block of steps and leaves out the blocks the same rule marks, judged against its best block. The ratio lines and
results name what was repeated and set aside; --rerender applies the same rule to the stored figures. To check it by
hand, --hog SECONDS@START keeps every core busy for SECONDS from START seconds after the bench starts; on 2 cores,
about 6 min:

    python scripts/measure/bench.py --strategies --baselines pad128 grouped loop trainer --hog 60@30 \
        --results_dir runs/hog --bench_page runs/hog/benchmark.md

The headline ratios should stay within 5% of an idle run's, and the report name the runs it repeated and set aside.

Model-state bytes per rank are measured by recipes/model/memstats.py after training and compared
with scripts/memory_model.py's prediction for the same strategy, world size and precision; so are the bytes each
rank sends per optimizer step (recipes/testing/commstats.py, counted by the probe in steps 3-6, against memory_model's
comm_bytes_per_step, the textbook figure; bench_report.COMM_NOTES says why a strategy departs from it).
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from recipes.checks.launch_checks import visible_gpus
from recipes.outputs.records import library_versions, read_jsonl
from recipes.testing.probe import COMM_VARIABLE
from recipes.training.accelerator import available_cores
from scripts import memory_model
from scripts.measure import bench_load, processes
from scripts.measure.bench_report import (BENCH_PAGE, MIB, epoch_figures, mib, ratio_lines, ratios, rerender,
                                          round_order, slug, throughput, update_readme, write_results)

REPO = Path(__file__).resolve().parents[2]

PYTHON = sys.executable
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
STRATEGIES = ("single", "ddp", "fsdp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "dataparallel")
BASELINES = ("loop", "trainer", "pad128", "grouped", "padding_free", "padding_free_grouped", "unfused", "eager_attn",
             "lora", "alternate")
# The baselines that are the recipe on one process (accelerate_configs/single.yaml) with other flags: padding to 128,
# length-grouped batches, no padding (recipes/model/padding_free.py) without and with length-grouped batches, torch's
# per-parameter AdamW instead of the fused one, eager attention instead of SDPA (the last two show what
# recipes/model/kernels.py's defaults give).
RECIPE_VARIANTS = {"pad128": ["--pad_to_max_length", "--max_length", "128"], "grouped": ["--group_by_length"],
                   "padding_free": ["--padding_free"], "padding_free_grouped": ["--padding_free", "--group_by_length"],
                   "unfused": ["--optim", "adamw_torch"], "eager_attn": ["--attn_implementation", "eager"],
                   "lora": ["--use_peft", "--lora_r", "8"]}
# `lora`: LoRA adapters (rank 8, the recipe's default targets) and the head on the frozen model
# (recipes/model/adapters.py); its state is predicted with the same rank (memory_model.shape_from_model lora_r), beside
# full fine-tuning's `single`.
LORA_R = 8
# The one-process runs in interleaved rounds, in launch order: the pairs that the goals compare are neighbours
# (padding_free_grouped-grouped-single-padding_free) but pad128-grouped, one apart (grouped has three partners), as
# are the recipe and the loop; odd rounds run backwards (A B C, C B A, A B C, ...) so that a slow drift of the
# machine's speed, which on a shared VM reaches 15% over a few minutes, cancels.
COMPARED = ("pad128", "padding_free_grouped", "grouped", "single", "padding_free", "loop", "trainer", "unfused",
            "eager_attn", "lora")
# The quick profile leaves out `unfused` and `eager_attn`: the kernel defaults are decided in one process by
# `make bench BENCH=kernels` (scripts/measure/bench_kernels.py: 20 block pairs, each ratio with its t interval), where 4
# rounds of whole launches could not tell them apart; their 8 launches (2.9 min on 2026-11-27) kept the quick profile
# over its 20 minutes (issue 37). BENCH=full still runs them.
QUICK_BASELINES = tuple(name for name in BASELINES if name not in ("unfused", "eager_attn"))
# The runs of the ratios that the goals judge (recipe / loop and Trainer / recipe in separate processes, grouping's and
# padding-free's speed-ups and padding-free with grouping / grouping): the quick profile runs them in more rounds
# than the other COMPARED runs (Profile.headline_repeats), since over 4 rounds a median's bootstrap interval is the
# rounds' min-max (docs/benchmark.md). Issue 36 asks for >= 8 rounds behind padding-free with grouping / grouping.
HEADLINE = ("padding_free_grouped", "grouped", "single", "padding_free", "loop", "trainer")


@dataclass
class ModelSpec:
    name: str  # the run-name prefix
    path: str  # model folder
    random_init: bool  # architecture-only folder: build from its config
    precision: str  # fp32 or bf16, for every run of this model
    learning_rate: float


@dataclass
class Profile:
    models: list
    steps: int = 60  # optimizer steps of every run: one epoch over steps x effective batch samples
    warmup_steps: int = 10  # first steps left out of throughput (allocation, first gathers, caches); they also hold
    # the steps whose collectives the probe counts (recipes/testing/probe.py COMM_STEPS, 3-6), slowed by its
    # dispatch mode
    per_device_batch: int = 16  # micro-batch per GPU (or CPU process); the effective batch scales with the world
    max_world: int = 8  # GPUs a multi-process run uses at most
    eval_samples: Optional[int] = None  # validation examples; None: the whole validation split
    repeats: int = 4  # interleaved rounds of the COMPARED runs (seed 42 + round); the ratios are medians over them
    headline_repeats: int = 0  # rounds of the HEADLINE runs in all: after the `repeats` rounds of every COMPARED
    # run, rounds of these alone until there are this many (0 or fewer than `repeats`: no extra rounds)
    alternate_rounds: int = 6  # epochs of the `alternate` run, each (steps - warm-up) / 5 blocks of 5 steps per side
    run_timeout: int = 900  # seconds before a run is killed and reported as timed out
    baselines: tuple = BASELINES  # the baselines run when --baselines is not given


TINY = ModelSpec("tiny", "artifacts/tiny-roberta", False, "fp32", 1e-3)
PROFILES = {
    "quick": Profile(models=[TINY], run_timeout=300, baselines=QUICK_BASELINES, headline_repeats=8),
    "full": Profile(models=[TINY, ModelSpec("roberta-base", "artifacts/roberta-base-shape", True, "bf16", 2e-5),
                            ModelSpec("roberta-large", "artifacts/roberta-large-shape", True, "bf16", 2e-5)],
                    run_timeout=1800),
    # torch.compile beside eager (scripts/measure/bench_compile.py): tiny and the roberta-base shape, fp32, 2 rounds
    "compile": Profile(models=[TINY, ModelSpec("roberta-base", "artifacts/roberta-base-shape", True, "fp32", 2e-5)],
                       repeats=2, run_timeout=1200),
}


@dataclass
class Run:
    model: str
    name: str  # strategy or baseline
    kind: str  # "strategy" or "baseline"
    status: str = "ok"  # ok, failed, skipped, timeout
    reason: str = ""
    round: int = 0  # interleaved round of a COMPARED run (seed 42 + round); every other run: round 0
    attempt: int = 0  # launch of this run and round: 0, then 1.. for the repeats of a disturbed COMPARED run
    seed: int = 42
    world: int = 1
    precision: str = "fp32"
    threads: int = 0  # intra-op threads of each process (on CPU: cores / processes)
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    step_time_s: Optional[float] = None  # median seconds per step after warm-up
    fast_step_time_s: Optional[float] = None  # 10th percentile: the steps no other process slowed
    epoch_s: Optional[float] = None  # seconds of all the training steps: the same samples in every COMPARED run
    padding_efficiency: Optional[float] = None  # real tokens / padded tokens (the positions the model computes)
    state_measured: Optional[int] = None  # model-state bytes per rank: the largest rank, after training
    state_predicted: Optional[int] = None  # memory_model's prediction on the same basis
    memory_ratio: Optional[float] = None
    comm_measured: Optional[float] = None  # bytes sent per rank per optimizer step (the largest rank)
    comm_predicted: Optional[float] = None  # the textbook figure, same convention (memory_model.comm_bytes_per_step)
    comm_ratio: Optional[float] = None
    comm_breakdown: dict = field(default_factory=dict)  # kind: [measured, predicted] bytes per step per rank
    peak_rss: Optional[int] = None  # peak resident set of the largest process (whole process, not model state)
    cuda_max_allocated: Optional[int] = None
    accuracy: Optional[float] = None
    final_loss: Optional[float] = None
    wall_s: Optional[float] = None  # the whole launch, start-up and evaluation included
    breakdown: dict = field(default_factory=dict)
    command: list = field(default_factory=list)
    run_dir: str = ""
    run_config: dict = field(default_factory=dict)
    ds_config: Optional[dict] = None
    effective_batch: int = 0
    cuda_max_reserved: Optional[int] = None
    model_flops_per_s: Optional[float] = None  # 6 x parameters x real tokens/s, plus attention
    mfu: Optional[float] = None  # model FLOP/s over the device's peak (GPU table, or the CPU's measured matmul peak)
    env: dict = field(default_factory=dict)  # variables this run adds to the shared environment
    alternate: list = field(default_factory=list)  # `alternate`: per block of steps, seconds of recipe, loop, Trainer
    cpu_s: Optional[float] = None  # CPU seconds of the launch's processes (scripts/measure/bench_load.py)
    cpu_share: Optional[float] = None  # cpu_s / (wall_s x threads x world)
    others_share: Optional[float] = None  # others' CPU / the machine's over the launch
    others_peak: Optional[float] = None  # the same at its worst over a stretch as long as the timed epoch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failure_reason(log: str) -> str:
    """The child's exception line, not the launcher's CalledProcessError that follows it."""
    lines = [ln.strip() for ln in log.splitlines()
             if re.match(r"^\s*[\w.]*(Error|Exception|Interrupt)\b", ln) and "CalledProcessError" not in ln]
    return lines[-1][:300] if lines else (log.strip().splitlines() or ["no output"])[-1][:300]


def ds_config_for(strategy: str, precision: str, runs_dir: Path) -> tuple[dict, Path]:
    """The shipped DeepSpeed JSON with bf16 switched to the run's precision (its other bf16 keys kept), written beside
    the runs."""
    config = memory_model.load_ds_config(strategy)
    config["bf16"] = {**config.get("bf16", {}), "enabled": precision == "bf16"}
    path = runs_dir / "ds_configs" / f"{strategy}_{precision}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return config, path


def plan_command(run: Run, spec: ModelSpec, profile: Profile, run_dir: Path, runs_dir: Path, recipe: str,
                 n_gpus: int) -> list:
    """The command line of one run; sets run.world, run.precision, run.ds_config and run.env."""
    run.precision = spec.precision
    run.world = world_of(run.name, n_gpus, profile.max_world)
    batch = effective_batch(run.name, n_gpus, profile)
    train_samples = profile.steps * batch
    shared = ["--model_name_or_path", spec.path, "--output_dir", str(run_dir), "--seed", str(run.seed),
              "--max_train_samples", str(train_samples), "--learning_rate", str(spec.learning_rate)]
    shared += ["--random_init"] if spec.random_init else []
    if run.name in ("loop", "trainer", "alternate") and n_gpus > 1:
        # One process on one GPU: Trainer would take every visible GPU (nn.DataParallel, a batch per GPU).
        run.env = {"CUDA_VISIBLE_DEVICES": first_gpu()}
    if run.name == "alternate":  # only its epoch times are reported: a small evaluation
        return [PYTHON, "scripts/measure/bench_baselines.py", "alternate", *shared, "--batch_size", str(batch),
                "--precision", spec.precision, "--rounds", str(profile.alternate_rounds), "--max_eval_samples", "64",
                "--warmup_steps", str(profile.warmup_steps)]
    shared += ["--max_eval_samples", str(profile.eval_samples)] if profile.eval_samples else []
    if run.name in ("loop", "trainer"):
        return [PYTHON, "scripts/measure/bench_baselines.py", run.name, *shared, "--batch_size", str(batch),
                "--precision", spec.precision]
    # --logging_steps 1: each step's time is taken after its loss is read, so on GPUs it is the step's real time
    # (as in the hand-written loop and Trainer with logging every step); by default the recipe reads every 10 steps.
    recipe_args = [recipe, *shared, "--max_train_steps", str(profile.steps), "--record_ranks", "--logging_steps", "1",
                   "--per_device_train_batch_size", str(batch // run.world), "--cpu_threads", str(run.threads)]
    recipe_args += RECIPE_VARIANTS.get(run.name, [])
    if run.name == "dataparallel":  # a plain python run: precision comes from the variable accelerate reads
        run.env = {"ACCELERATE_MIXED_PRECISION": "bf16" if spec.precision == "bf16" else "no"}
        return [PYTHON, *recipe_args, "--data_parallel"]
    strategy = "single" if run.name in RECIPE_VARIANTS else run.name
    launch = [PYTHON, ACCELERATE, "launch", "--config_file", f"accelerate_configs/{strategy}.yaml",
              "--num_processes", str(run.world), "--main_process_port", str(free_port())]
    if strategy.startswith("zero"):  # the JSON holds the precision; --mixed_precision beside it is an error
        run.ds_config, path = ds_config_for(strategy, spec.precision, runs_dir)
        launch += ["--deepspeed_config_file", str(path)]
    else:
        launch += ["--mixed_precision", "bf16" if spec.precision == "bf16" else "no"]
    return [*launch, *recipe_args]


def first_gpu() -> str:
    """The first GPU this process may use, as CUDA_VISIBLE_DEVICES names it, for a run pinned to one GPU."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"


def world_of(name: str, n_gpus: int, max_world: int = 8) -> int:
    """Processes of a run: multi-process strategies on every GPU (at most max_world), or 2 CPU processes; the rest
    one process."""
    multi = name in STRATEGIES and name not in ("single", "dataparallel")
    return min(n_gpus, max_world) if multi and n_gpus else (2 if multi else 1)


def effective_batch(name: str, n_gpus: int, profile: Profile) -> int:
    """Samples per optimizer step: the fixed per-device batch times the devices the run computes on. nn.DataParallel
    splits one process's batch over the GPUs, so it gets the batch of all of them."""
    devices = min(n_gpus, profile.max_world) if name == "dataparallel" else world_of(name, n_gpus, profile.max_world)
    return profile.per_device_batch * max(1, devices)


def skip_reason(run: Run, n_gpus: int, spec: Optional[ModelSpec] = None) -> str:
    if run.name == "dataparallel" and n_gpus < 2:
        return f"needs more than one visible GPU ({n_gpus} visible)"
    if run.name == "lora":
        if importlib.util.find_spec("peft") is None:
            return "needs the lora extra (pip install -e .[lora])"
        if spec is not None and spec.random_init:
            return "LoRA adapts pretrained weights; this model is built from random init"
    return ""


def plan(profile: Profile, n_gpus: int, names=(*STRATEGIES, *BASELINES)) -> list[dict]:
    """What the bench will run on a machine with `n_gpus` GPUs: processes, batches and skip reasons, per run."""
    rows = []
    for name in names:
        run = Run(model="-", name=name, kind="baseline" if name in BASELINES else "strategy")
        world = world_of(name, n_gpus, profile.max_world)
        batch = effective_batch(name, n_gpus, profile)
        rows.append({"name": name, "world": world, "effective_batch": batch, "per_process_batch": batch // world,
                     "skipped": skip_reason(run, n_gpus)})
    return rows


def execute(run: Run, command: list, run_dir: Path, profile: Profile, env: dict) -> list:
    """Run one command in its own process group, log to run_dir/launch.log, set status, reason, wall time and CPU
    seconds; returns the samples of its CPU and the machine's (bench_load.LaunchMeter)."""
    run.command = command
    log_path = run_dir / "launch.log"
    meter = bench_load.LaunchMeter()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        meter.start(proc.pid)
        try:
            proc.wait(timeout=profile.run_timeout)
        except subprocess.TimeoutExpired:
            processes.kill_launch(proc)  # the launcher and the ranks it started
            run.status, run.reason = "timeout", f"killed after {profile.run_timeout} s"
    run.wall_s = time.perf_counter() - start
    run.cpu_s = meter.stop()
    if run.status == "ok" and proc.returncode != 0:
        run.status, run.reason = "failed", failure_reason(log_path.read_text(errors="replace"))
    return meter.samples


def record_load(run: Run, samples: list) -> None:
    """The run's CPU share and others' beside it (module docstring), once its epoch time is known."""
    if run.cpu_s is not None and run.wall_s:
        run.cpu_share = run.cpu_s / (run.wall_s * max(1, run.threads) * run.world)
    samples = samples or []  # a launch measured elsewhere (tests replace execute) has no samples
    run.others_share = bench_load.others_share(samples)
    run.others_peak = bench_load.others_share(samples, run.epoch_s)


# The multi-machine configs launch these strategies across machines (scripts/gpu_check.py runs them).
MULTI_MACHINE = {"multinode": "ddp", "zero2_multinode": "zero2"}


def strategy_of(run: Run) -> str:
    """The memory-model strategy a run is predicted as."""
    name = MULTI_MACHINE.get(run.name, run.name)
    return name if name in memory_model.STRATEGIES and name != "single" else "single"


def collect(run: Run, run_dir: Path, profile: Profile, shape: memory_model.ModelShape) -> None:
    """Throughput, accuracy, memory (measured vs predicted) and the resolved config of a finished run."""
    if run.name == "alternate":
        turns = json.loads((run_dir / "alternate.json").read_text())
        if not turns["same_batches"]:
            run.status, run.reason = "failed", "alternate: the recipe, the loop and Trainer computed different batches"
        run.alternate = turns["blocks"]
        return
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if len(metrics) != profile.steps:
        run.status, run.reason = "failed", f"{len(metrics)} of {profile.steps} steps recorded"
        return
    for key, value in {**throughput(metrics, profile.warmup_steps), **epoch_figures(metrics)}.items():
        setattr(run, key, value)
    run.final_loss = metrics[-1]["loss"]
    evals = read_jsonl(run_dir / "eval.jsonl")
    run.accuracy = evals[-1]["accuracy"] if evals else None
    run.run_config = json.loads((run_dir / "run_config.json").read_text())
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json"))]
    if not records:
        return
    collect_comm(run, records, shape)
    ranks = [r["memory"] for r in records]
    largest = max(ranks, key=lambda m: m["live_tensor_bytes"])
    run.state_measured = largest["live_tensor_bytes"]
    run.peak_rss = max(m["peak_rss_bytes"] for m in ranks)
    run.cuda_max_allocated = max((m.get("cuda_max_allocated_bytes", 0) for m in ranks), default=0) or None
    run.cuda_max_reserved = max((m.get("cuda_max_reserved_bytes", 0) for m in ranks), default=0) or None
    parts = memory_model.predict(strategy_of(run), shape, run.world, run.precision, ds_config=run.ds_config,
                                 comm_counted=run.comm_measured is not None)
    predicted = memory_model.totals(parts)
    run.state_predicted = predicted["after_eval"]
    run.memory_ratio = run.state_measured / run.state_predicted
    # memstats cannot tell DeepSpeed's gradient buffers from its buckets: both land in "other"
    run.breakdown = {
        "parameters": [largest["parameters_bytes"], predicted["parameters_after_eval"]],
        "optimizer_state": [largest["optimizer_state_bytes"], predicted["optimizer_state_after_eval"]],
        "gradients_and_other": [largest["gradients_bytes"] + largest["other_bytes"],
                                predicted["gradients_after_eval"] + predicted["buffers_after_eval"]],
    }


def collect_comm(run: Run, records: list, shape: memory_model.ModelShape) -> None:
    """Bytes sent per optimizer step by the busiest rank (the probe's counted steps without an evaluation), per kind
    of collective, beside the textbook prediction."""
    comms = [r["comm"] for r in records if r.get("comm", {}).get("comm_bytes_per_step") is not None]
    if not comms:
        return
    busiest = max(comms, key=lambda c: c["comm_bytes_per_step"])
    run.comm_measured = busiest["comm_bytes_per_step"]
    predicted = memory_model.comm_bytes_per_step(strategy_of(run), shape, run.world, run.precision)
    run.comm_predicted = predicted["total"]
    run.comm_ratio = run.comm_measured / run.comm_predicted if run.comm_predicted else None
    clean = [step["collectives"] for step in busiest["steps"].values() if not step["evaluated"]]
    kinds = sorted({kind for step in clean for kind in step} | set(predicted["terms"]))
    run.comm_breakdown = {kind: [sum(step.get(kind, {}).get("sent_bytes", 0.0) for step in clean) / len(clean),
                                 predicted["terms"].get(kind, 0.0)] for kind in kinds}


# Dense peak FLOP/s per GPU from the vendors' data sheets (bf16 tensor core without sparsity; fp32 is TF32 tensor
# core, which the recipe's fp32 runs use on GPUs, recipes/training/accelerator.py use_tf32_matmuls).
GPU_PEAK_FLOPS = {  # name fragment: (bf16, fp32)
    "H200": (989e12, 494e12), "H100 PCIe": (756e12, 378e12), "H100": (989e12, 494e12), "A100": (312e12, 156e12),
    "A10G": (70e12, 35e12), "L40S": (362e12, 183e12), "L4": (121e12, 60e12), "A6000": (155e12, 77e12),
    "4090": (165e12, 83e12),
    "V100": (125e12, 15.7e12), "T4": (65e12, 8.1e12),  # fp16 tensor cores; these cards have no bf16
}


def model_flops(shape: memory_model.ModelShape, tokens_per_s: float, seq_len: int = 128) -> float:
    """Training FLOP/s the model needs for `tokens_per_s` real tokens: 6 per parameter per token (forward 2,
    backward 4) plus attention's scores and weighted sum, 12 x layers x hidden x sequence per token."""
    attention = 12 * shape.num_layers * shape.hidden_size * seq_len
    return (6 * shape.num_params + attention) * tokens_per_s


def device_peak_flops(precision: str, n_gpus: int, threads: int) -> float | None:
    """Peak FLOP/s of one device: the data-sheet value of the GPU, or on CPU a measured matmul rate."""
    import torch

    if n_gpus:
        name = torch.cuda.get_device_name(0)
        for fragment, (bf16, fp32) in GPU_PEAK_FLOPS.items():
            if fragment in name:
                return bf16 if precision == "bf16" else fp32
        return None  # a GPU missing from the table: no MFU rather than a made-up one
    return cpu_matmul_flops(torch.bfloat16 if precision == "bf16" else torch.float32, threads)


def compute_devices(world: int, effective_batch: int, per_device_batch: int, on_gpus: bool) -> int:
    """What MFU divides the peak over: the GPUs a run computed on (nn.DataParallel: every GPU from one process), or
    on CPU its processes, each of which has the threads its peak was measured on (until 2026-11-27 a CPU run counted
    as one device whatever its processes, which put the 2-process runs' MFU at twice its value, above 100%)."""
    return effective_batch // per_device_batch if on_gpus else world


def cpu_matmul_flops(dtype, threads: int, n: int = 1024, repeats: int = 10) -> float:
    """The best of `repeats` n x n matmuls on `threads` threads: what this CPU reaches on the model's main op."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    return 2 * n**3 / best


def threads_of(world: int) -> int:
    """Intra-op threads per process of a run on `world` processes: the machine's cores shared out, so every run has
    the same budget (the machine) and none oversubscribes it. Without this, accelerate launch would give each process
    1 thread (OMP_NUM_THREADS=1 unless the config says use_cpu, accelerate 1.15.0) and a plain `python` run all."""
    return max(1, available_cores() // world)


def run_env(threads: int, world: int) -> dict:
    """The environment of every run, with its threads per process. The probe counts the collectives of steps 3-6
    (inside the warm-up) of the multi-process runs only: one process has none, and its dispatch mode would slow those
    steps (2-3% of the one-process runs' epoch, which the ratios compare)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            "HF_DATASETS_OFFLINE": os.environ.get("HF_DATASETS_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false",
            COMM_VARIABLE: "1" if world > 1 else "0"}


def schedule_runs(names, repeats: int, headline_repeats: int = 0) -> list[tuple[str, int]]:
    """(name, round) in launch order: the COMPARED one-process runs first, in `repeats` interleaved rounds (A B C,
    C B A, A B C, ...), then the HEADLINE ones among them in further rounds up to `headline_repeats` in all, then the
    multi-process runs once."""
    compared = [name for name in COMPARED if name in names]
    headline = [name for name in compared if name in HEADLINE]
    rest = [name for name in names if name not in COMPARED]
    rest.sort(key=lambda name: name == "dataparallel")
    rounds = [(name, r) for r in range(max(1, repeats)) for name in round_order(compared, r)]
    rounds += [(name, r) for r in range(max(1, repeats), headline_repeats) for name in round_order(headline, r)]
    return rounds + [(name, 0) for name in rest]


def format_row(run: Run, mem_label: str) -> str:
    def num(value, fmt):
        return format(value, fmt) if value is not None else "-"

    peak = run.cuda_max_allocated if mem_label == "CUDA max alloc" else run.peak_rss
    name = run.name + (f"#{run.round}" if run.round else "") + (f"/a{run.attempt}" if run.attempt else "")
    if run.status != "ok":
        return f"{run.model:<14}{name:<15}{run.status}: {run.reason}"
    return (f"{run.model:<14}{name:<15}{run.world:>3}{run.precision:>6}{num(run.samples_per_s, '10.1f')}"
            f"{num(run.tokens_per_s, '10.0f')}{num(run.step_time_s, '9.3f')}{num(run.fast_step_time_s, '8.3f')}"
            f"{num(run.state_measured and run.state_measured / MIB, '11.2f')}"
            f"{num(run.state_predicted and run.state_predicted / MIB, '11.2f')}{num(run.memory_ratio, '7.3f')}"
            f"{num(mib(run.comm_measured), '9.2f')}{num(mib(run.comm_predicted), '9.2f')}"
            f"{num(run.comm_ratio, '7.3f')}"
            f"{num(peak and peak / MIB, '10.0f')}{num(run.accuracy, '7.3f')}{num(run.epoch_s, '8.2f')}"
            f"{num(run.padding_efficiency, '6.3f')}{num(run.wall_s, '7.0f')}")


def header(mem_label: str) -> str:
    return (f"{'model':<14}{'run':<15}{'np':>3}{'prec':>6}{'samples/s':>10}{'tokens/s':>10}{'s/step':>9}{'p10':>8}"
            f"{'state MiB':>11}{'predicted':>11}{'ratio':>7}{'comm MiB':>9}{'predict':>9}{'ratio':>7}"
            f"{mem_label[:10]:>10}{'acc':>7}{'epoch s':>8}{'pad':>6}{'wall s':>7}")


def hardware() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    info = {"host": socket.gethostname().split(".")[0], "cpu": cpu, "cpu_cores": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        info["memory_gib"] = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1024**3, 1)
    info["device"] = info["gpus"][0] if info["gpus"] else "cpu"
    return info


def progress(line: str) -> None:
    print(line, flush=True)  # flushed: `make bench | tee` shows each run as it ends


def run_one(spec: ModelSpec, name: str, round_: int, profile: Profile, runs_dir: Path, recipe: str, n_gpus: int,
            shape: memory_model.ModelShape, peaks: dict, attempt: int = 0) -> Run:
    """One run of the schedule: planned, launched in an empty run folder, measured; MFU against the peak of every
    device it computed on (`peaks`, a cache of device_peak_flops by precision and threads, filled here)."""
    run = Run(model=spec.name, name=name, kind="baseline" if name in BASELINES else "strategy", round=round_,
              seed=42 + round_, attempt=attempt)
    run_dir = runs_dir / (f"{spec.name}_{name}" + (f"_r{round_}" if round_ else "")
                          + (f"_a{attempt}" if attempt else ""))
    run.run_dir = str(run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir)
    run.reason = skip_reason(run, n_gpus, spec)
    if run.reason:
        run.status = "skipped"
        return run
    shutil.rmtree(run_dir, ignore_errors=True)  # no records of an earlier run may be read as this one's
    run_dir.mkdir(parents=True)
    run.threads = threads_of(world_of(name, n_gpus, profile.max_world))
    command = plan_command(run, spec, profile, run_dir, runs_dir, recipe, n_gpus)
    run.effective_batch = effective_batch(name, n_gpus, profile)
    samples = execute(run, command, run_dir, profile, {**run_env(run.threads, run.world), **run.env})
    if run.status == "ok":  # a LoRA run's state is predicted for its trainable part; its FLOPs stay the full model's
        collect(run, run_dir, profile, lora_shape(spec) if name == "lora" else shape)
    record_load(run, samples)
    if run.status == "ok" and run.tokens_per_s:
        key = (run.precision, run.threads)
        if key not in peaks:
            peaks[key] = device_peak_flops(run.precision, n_gpus, run.threads)
        run.model_flops_per_s = model_flops(shape, run.tokens_per_s)
        devices = compute_devices(run.world, run.effective_batch, profile.per_device_batch, bool(n_gpus))
        run.mfu = run.model_flops_per_s / (peaks[key] * devices) if peaks[key] else None
    return run


def model_shape(spec: ModelSpec, lora_r: Optional[int] = None) -> memory_model.ModelShape:
    """The memory model's shape of spec's model (a folder of the checkout, or a Hub id); with `lora_r`, of the
    model with the recipe's default LoRA at that rank."""
    path = str(REPO / spec.path) if (REPO / spec.path).exists() else spec.path
    return memory_model.shape_from_model(path, lora_r=lora_r)


def lora_shape(spec: ModelSpec) -> memory_model.ModelShape:
    """The memory model's shape of the `lora` run: the model with the recipe's default LoRA at rank LORA_R."""
    return model_shape(spec, LORA_R)


def run_bench(profile: Profile, strategies=STRATEGIES, baselines=BASELINES, runs_dir: Path = REPO / "runs" / "bench",
              recipe: str = "recipes/cls.py", log=progress) -> dict:
    """Every run of the profile, one after the other; prints each run's line when it ends. Returns the results."""
    n_gpus = visible_gpus()
    mem_label = "CUDA max alloc" if n_gpus else "peak RSS"
    started = dt.datetime.now()
    names = (*strategies, *baselines)
    schedule = schedule_runs(names, profile.repeats, profile.headline_repeats)
    more = list(dict.fromkeys(name for name, r in schedule if r >= max(1, profile.repeats)))  # the HEADLINE rounds
    log(f"bench: {len(profile.models)} model(s) x {len(schedule)} runs ({profile.repeats} interleaved rounds of "
        f"{', '.join(n for n in names if n in COMPARED)}"
        + (f"; {profile.headline_repeats} in all of {', '.join(more)}" if more else "")
        + f"), {profile.steps} steps ({profile.warmup_steps} warm-up), {profile.per_device_batch} per device; "
        "state MiB per rank (measured, predicted); comm MiB sent per rank per optimizer step (measured, textbook); "
        f"{mem_label} MiB of the largest process; epoch s: all training steps; pad: real / padded tokens")
    log("      " + header(mem_label))
    runs = []
    peaks = {}
    for m, spec in enumerate(profile.models):
        shape = model_shape(spec)
        for i, (name, round_) in enumerate(schedule, m * len(schedule)):
            for run in run_undisturbed(spec, name, round_, profile, runs_dir, recipe, n_gpus, shape, peaks, runs,
                                       log):
                runs.append(run)
                log(f"{i + 1:>2}/{len(schedule) * len(profile.models):<3}" + format_row(run, mem_label))
    runs.sort(key=lambda r: ([spec.name for spec in profile.models].index(r.model), r.round, names.index(r.name),
                             r.attempt))
    work = {spec.name: {"model": spec.path, "random_init": spec.random_init, "precision": spec.precision,
                        "learning_rate": spec.learning_rate, "steps": profile.steps,
                        "warmup_steps": profile.warmup_steps, "per_device_batch": profile.per_device_batch,
                        "effective_batch": {r["name"]: r["effective_batch"] for r in plan(profile, n_gpus, names)},
                        "eval_samples": profile.eval_samples or "all", "repeats": profile.repeats,
                        "headline_repeats": max(profile.repeats, profile.headline_repeats),
                        "max_length": 128, "seed": 42} for spec in profile.models}
    return {"date": started.strftime("%Y-%m-%d"), "started": started.isoformat(timespec="seconds"),
            "duration_s": (dt.datetime.now() - started).total_seconds(), "hardware": hardware(),
            "versions": library_versions(), "memory_label": mem_label, "work": work,
            "peak_flops": {f"{prec} x{threads} threads": v for (prec, threads), v in peaks.items()},
            "runs": [asdict(r) for r in runs], "ratios": ratios([asdict(r) for r in runs]),
            "padding": {spec.name: padding_costs(spec, profile) for spec in profile.models}}


def run_undisturbed(spec: ModelSpec, name: str, round_: int, profile: Profile, runs_dir: Path, recipe: str,
                    n_gpus: int, shape: memory_model.ModelShape, peaks: dict, done: list, log=progress):
    """One run of the schedule, and for a COMPARED run that the rule calls disturbed (bench_load.disturbance, against
    the runs `done` so far) up to bench_load.MAX_REPEATS launches more of the same run and round; yields each."""
    for attempt in range(bench_load.MAX_REPEATS + 1):
        run = run_one(spec, name, round_, profile, runs_dir, recipe, n_gpus, shape, peaks, attempt)
        yield run
        why = bench_load.disturbance(asdict(run), [asdict(r) for r in done])
        if name not in COMPARED or not why:
            return
        log(f"      {bench_load.label(asdict(run))} disturbed ({why})"
            + (": again" if attempt < bench_load.MAX_REPEATS else ": set aside"))


def start_hog(seconds: float, start: float, log=progress) -> threading.Timer:
    """--hog: one busy loop per core from `start` seconds on for `seconds`, beside the bench (a check of the
    disturbance rule by hand); returns the timer, so that the bench can cancel one not yet fired."""
    loop = f"import time; end = time.time() + {seconds}\nwhile time.time() < end: pass"

    def hog():
        log(f"      hog: {os.cpu_count()} busy loops for {seconds:.0f} s")
        # started by a shell that returns at once: not this process's children, so their CPU never joins a run's
        # (getrusage counts the children this process reaps)
        one = f"{shlex.quote(PYTHON)} -c {shlex.quote(loop)} &"
        subprocess.run(["sh", "-c", " ".join([one] * (os.cpu_count() or 1))], check=True)

    timer = threading.Timer(start, hog)
    timer.daemon = True
    timer.start()
    return timer


def padding_costs(spec: ModelSpec, profile: Profile, multiple: int = 8) -> dict:
    """Real / padded tokens over one epoch of the profile's training batches (one process), counted from the
    recipe's own loaders without training: dynamic and length-grouped batches, padded to the longest and rounded up
    to a multiple of `multiple` (--pad_to_multiple_of, for tensor cores)."""
    from transformers import AutoTokenizer

    from recipes import cls
    from recipes.inputs import data

    base = ["--model_name_or_path", spec.path, "--per_device_train_batch_size", str(profile.per_device_batch),
            "--max_train_samples", str(profile.steps * profile.per_device_batch), "--max_length", "128"]
    tokenizer = AutoTokenizer.from_pretrained(spec.path)
    costs = {}
    for name, flags in (("dynamic", []), ("grouped", ["--group_by_length"])):
        cfg = cls.parse_config(base + flags)
        train_ds, eval_ds, _ = data.prepare_datasets(cfg, tokenizer)
        for pad in (None, multiple):
            cfg.pad_to_multiple_of = pad
            loader = data.build_loaders(cfg, train_ds, eval_ds, tokenizer, world_size=1).train
            real = padded = 0
            for batch in loader:
                real += int(batch["attention_mask"].sum())
                padded += batch["attention_mask"].numel()
            costs[name if pad is None else f"{name}_pad{pad}"] = real / padded
    return costs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=("quick", "full"), default="quick",
                        help="compile (torch.compile vs eager) is scripts/measure/bench_compile.py: "
                        "make bench BENCH=compile")
    parser.add_argument("--strategies", nargs="*", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--baselines", nargs="*", choices=BASELINES,
                        help="the baselines to run (default: the profile's; the quick profile leaves out unfused and "
                        "eager_attn)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="override every model's precision")
    parser.add_argument("--model_name_or_path", help="bench this model instead of the profile's (any encoder a "
                        "sequence classifier is built from; a folder without weights trains from random init); the "
                        "docs/benchmark.md is left alone")
    parser.add_argument("--recipe", default="recipes/cls.py", help="the recipe to launch (to compare two versions)")
    parser.add_argument("--runs_dir", default=str(REPO / "runs" / "bench"))
    parser.add_argument("--results_dir", default=str(REPO / "results"))
    parser.add_argument("--bench_page", "--readme", dest="bench_page", default=str(BENCH_PAGE),
                        help="the page whose block between the bench markers gets the new table (default: "
                        "docs/benchmark.md; README.md quotes only the headline ratios, checked by tests/test_docs.py)")
    parser.add_argument("--hog", metavar="SECONDS@START", help="keep every core busy for SECONDS from START seconds "
                        "after the start, beside the bench: a check that it sets the disturbed runs aside")
    parser.add_argument("--rounds", type=positive_int, metavar="N",
                        help="interleaved rounds of every compared run instead of the profile's (the headline ones "
                        "included): a longer measurement of a few ratios, e.g. --strategies single --baselines loop "
                        "trainer --rounds 16")
    parser.add_argument("--alternate_rounds", type=positive_int, metavar="N",
                        help="epochs of the `alternate` run (each (steps - warm-up) / 5 blocks of 5 steps per side) "
                        "instead of the profile's")
    parser.add_argument("--tag", type=results_tag,
                        help="name the results <date>_<tag>_<device>_<host> and leave the bench page alone: a "
                        "measurement beside `make bench`'s, not one the pages quote as the latest")
    parser.add_argument("--rerender", metavar="RESULTS_JSON",
                        help="recompute throughput and ratios of a results file from its runs' records, rewrite it")
    args = parser.parse_args(argv)
    if args.rerender:
        results = rerender(Path(args.rerender))
    else:
        profile = replace(PROFILES[args.profile])  # a copy: the options below change it
        if args.model_name_or_path:
            profile.models = [custom_model(args.model_name_or_path)]
        if args.rounds:
            profile.repeats = profile.headline_repeats = args.rounds
        if args.alternate_rounds:
            profile.alternate_rounds = args.alternate_rounds
        if args.precision:
            for spec in profile.models:
                spec.precision = args.precision
        if args.hog:
            seconds, start = (float(v) for v in args.hog.split("@"))
            hog = start_hog(seconds, start)
        baselines = profile.baselines if args.baselines is None else args.baselines
        results = run_bench(profile, args.strategies, baselines, Path(args.runs_dir).resolve(), args.recipe)
        if args.hog:
            hog.cancel()
        results["command"] = "python scripts/measure/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
        if args.tag:
            results["tag"] = args.tag
    paths = write_results(results, Path(args.results_dir), replace=bool(args.rerender))
    print("\n".join(["", *ratio_lines(results), ""]))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if not args.model_name_or_path and not results.get("tag"):  # the page quotes the shipped profiles only
        update_readme(Path(args.bench_page), results, paths)


def positive_int(text: str) -> int:
    """A count of rounds: 0 would otherwise leave the profile's count, and a negative one round, without a word."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def results_tag(text: str) -> str:
    """A tag that names files: letters, digits and dashes once slugged (an empty one would leave the run untagged and
    let a partial run replace the page's figures)."""
    if not slug(text):
        raise argparse.ArgumentTypeError(f"{text!r} has no letter or digit to name the results by")
    return text


def custom_model(name_or_path: str) -> ModelSpec:
    """A ModelSpec for --model_name_or_path: fp32 and the tiny model's learning rate (a few steps on few samples),
    from random init when the folder holds a config but no weights."""
    from recipes.model.source import WEIGHT_FILES

    folder = Path(name_or_path)
    random_init = folder.is_dir() and not any((folder / f).is_file() for f in WEIGHT_FILES)
    return ModelSpec(folder.name or name_or_path, name_or_path, random_init, "fp32", 1e-3)


if __name__ == "__main__":
    main()
