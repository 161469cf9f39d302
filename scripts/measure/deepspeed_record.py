"""A dated record of the DeepSpeed figures the docs quote: ZeRO-1's model state against the memory model, the host
reads each ZeRO config makes per optimizer step, and ZeRO-3's collectives with its bucket sizes as shipped or "auto".

    python scripts/measure/deepspeed_record.py  # results/<date>_deepspeed_<device>_<host>.json, about 10 min on 2 cores

Nine launches of the recipe, 2 processes, bf16 as the JSONs ship it, each with --record_ranks and CLS_COMM=1
(recipes/testing/probe.py). On the tiny model: zero1, zero1 with "data_types": {"grad_accum_dtype": "fp32"}
(DeepSpeed 0.19.8 then runs stage 1 through its BF16_Optimizer), zero2, zero2 with "check_grad_overflow": true,
zero3, zero3 with its three bucket sizes at "auto" (Accelerate fills them from hidden_size), zero2_offload; on the
roberta-base shape (random init, micro-batch 4): zero3 as shipped and with "auto" sizes. The changed JSONs are
written beside the launches' folders (a temporary folder unless --runs_dir); the shipped ones are launched as the
YAMLs name them.

For each launch the record holds:
- memory: the model-state bytes of the largest rank after training and evaluation (recipes/model/memstats.py), the
  prediction of scripts/memory_model.py for the same strategy, JSON and precision, and measured / predicted, as
  `make bench` computes them for its fp32 runs;
- host_reads_per_step: rank 0's host reads of tensor values (`.item()`, `bool()`) per optimizer step, by the module
  that made them (recipes/testing/commstats.py), in steps 3-6 (probe.COMM_STEPS); the run trains one step more so
  that none of them holds the final evaluation. Each step's counts are kept too: they are the same in every step;
- collectives_per_step: rank 0's calls and bytes sent of each kind of collective in the first counted step (the
  counted steps must agree on the calls);
- what ran: the optimizer chain and DeepSpeed's overflow check as rank 0 recorded them, the JSON it was given.

docs/tutorials.md (ZeRO-1) and ds_configs/README.md (Host syncs) quote the newest record; tests/test_docs.py holds
them to it.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recipes.outputs.records import library_versions
from recipes.testing.probe import COMM_STEPS
from scripts import memory_model
from scripts.measure.bench import ACCELERATE, REPO, failure_reason, free_port, hardware, run_env, threads_of
from scripts.measure.run_record import results_path

WORLD = 2
PRECISION = "bf16"
# ZeRO-3's three sizes left to Accelerate, as zero3.json had them before (ds_configs/README.md, "Bucket sizes")
AUTO_BUCKETS = {"zero_optimization": {"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                      "stage3_param_persistence_threshold": "auto"}}
BASE = "artifacts/roberta-base-shape"  # a config and tokenizer, no weights: built with --random_init
# name: (shipped config, keys changed in its JSON (a dict value is merged into the JSON's own), model: None for
# --model_name_or_path)
VARIANTS = {
    "zero1": ("zero1", {}, None),
    "zero1_fp32_accum": ("zero1", {"data_types": {"grad_accum_dtype": "fp32"}}, None),
    "zero2": ("zero2", {}, None),
    "zero2_overflow_check": ("zero2", {"bf16": {"check_grad_overflow": True}}, None),
    "zero3": ("zero3", {}, None),
    "zero3_auto_buckets": ("zero3", AUTO_BUCKETS, None),
    "zero2_offload": ("zero2_offload", {}, None),
    "zero3_base": ("zero3", {}, BASE),
    "zero3_auto_buckets_base": ("zero3", AUTO_BUCKETS, BASE),
}
STEPS = COMM_STEPS.stop  # the counted steps and one more, which ends with the final evaluation
MICRO_BATCH = 16  # per process, as `make bench` (its per-device batch)
BASE_MICRO_BATCH = 4  # the roberta-base shape's steps cost about 40 of the tiny model's
# The recipe keeps the final evaluation's gathered logits and labels to the end (recipes/outputs/report.py Kept), about
# 16 bytes an example, which memstats counts beside the model state ("other"): 1 KB for 64 examples, 55 KB (0.5% of the
# tiny model's bf16 state) for the whole split of 3513.
EVAL_SAMPLES = 64


def ds_config(strategy: str, changes: dict) -> dict:
    config = memory_model.load_ds_config(strategy)
    for key, value in changes.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def model_of(name: str, default: str) -> str:
    return VARIANTS[name][2] or default


def launch(name: str, model: str, run_dir: Path, eval_samples: int | None) -> float:
    """One launch of the recipe for variant `name`, its log in run_dir/launch.log; returns its wall seconds."""
    strategy, changes, _ = VARIANTS[name]
    micro_batch = BASE_MICRO_BATCH if model == BASE else MICRO_BATCH
    threads = threads_of(WORLD)
    run_dir.mkdir(parents=True)
    command = [ACCELERATE, "launch", "--config_file", f"accelerate_configs/{strategy}.yaml",
               "--num_processes", str(WORLD), "--main_process_port", str(free_port())]
    if changes:
        path = run_dir.parent / f"{name}.json"
        path.write_text(json.dumps(ds_config(strategy, changes), indent=2) + "\n")
        command += ["--deepspeed_config_file", str(path)]
    command += ["recipes/cls.py", "--model_name_or_path", model, "--output_dir", str(run_dir),
                "--max_train_steps", str(STEPS), "--max_train_samples", str(STEPS * micro_batch * WORLD),
                "--per_device_train_batch_size", str(micro_batch),
                "--learning_rate", "1e-3", "--cpu_threads", str(threads), "--record_ranks", "--eval_report", "false"]
    command += ["--random_init"] if model == BASE else []
    command += ["--max_eval_samples", str(eval_samples)] if eval_samples else []
    start = time.perf_counter()
    with open(run_dir / "launch.log", "w") as log:
        proc = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=run_env(threads, WORLD),
                              start_new_session=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {name} failed ({failure_reason((run_dir / 'launch.log').read_text())}); "
                         f"log: {run_dir / 'launch.log'}")
    return time.perf_counter() - start


def host_reads(rank0: dict) -> tuple[dict, dict]:
    """Rank 0's host reads per counted step by module, and each step's; a step that differs from the others stops
    the record, since then no one figure per step exists."""
    steps = {int(k): s for k, s in rank0["comm"]["steps"].items()}
    if sorted(steps) != list(COMM_STEPS) or any(s["evaluated"] for s in steps.values()):
        raise SystemExit(f"error: counted steps {sorted(steps)}, expected {list(COMM_STEPS)} without an evaluation")
    by_step = {str(k): s["host_reads"] for k, s in sorted(steps.items())}
    if len({json.dumps(reads, sort_keys=True) for reads in by_step.values()}) != 1:
        raise SystemExit(f"error: the host reads differ between the counted steps: {by_step}")
    return next(iter(by_step.values())), by_step


def collectives(rank0: dict) -> dict:
    """Rank 0's calls and bytes sent of each kind of collective in one counted step (the steps agree on the calls)."""
    steps = [s["collectives"] for _, s in sorted(rank0["comm"]["steps"].items(), key=lambda item: int(item[0]))]
    calls = [{kind: c["calls"] for kind, c in step.items()} for step in steps]
    if any(c != calls[0] for c in calls):
        raise SystemExit(f"error: the collectives differ between the counted steps: {calls}")
    return {kind: {"calls": c["calls"], "sent_bytes": c["sent_bytes"]} for kind, c in steps[0].items()}


def measure(name: str, run_dir: Path, shape: memory_model.ModelShape) -> dict:
    """What a finished launch recorded: its memory against the prediction, rank 0's host reads and collectives, what
    ran."""
    strategy, changes, _ = VARIANTS[name]
    config = ds_config(strategy, changes)
    run_config = json.loads((run_dir / "run_config.json").read_text())
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank*.json"))]
    if run_config["world_size"] != WORLD or len(ranks) != WORLD or run_config["mixed_precision"] != PRECISION:
        raise SystemExit(f"error: {name} ran on {run_config['world_size']} processes in "
                         f"{run_config['mixed_precision']} with {len(ranks)} rank records")
    measured = max(r["memory"]["live_tensor_bytes"] for r in ranks)
    predicted = memory_model.totals(memory_model.predict(strategy, shape, WORLD, PRECISION, ds_config=config,
                                                         comm_counted=True))["after_eval"]
    per_step, by_step = host_reads(ranks[0])
    return {"config": strategy, "changes": changes, "ds_config": config,
            "world_size": run_config["world_size"], "mixed_precision": run_config["mixed_precision"],
            "optimizer": ranks[0]["optimizer"],
            "memory": {"measured_bytes": measured, "predicted_bytes": predicted, "ratio": measured / predicted},
            "host_reads_per_step": per_step, "host_reads_by_step": by_step,
            "collectives_per_step": collectives(ranks[0])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", default="artifacts/tiny-roberta")
    parser.add_argument("--max_eval_samples", type=int, default=EVAL_SAMPLES, help="examples of the final "
                        "evaluation (0: the whole validation split)")
    parser.add_argument("--runs_dir", default=None, help="keep the launches' folders here (default: a temporary "
                        "folder, removed afterwards)")
    parser.add_argument("--results_dir", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deepspeed_record_") as scratch:
        runs_dir = Path(args.runs_dir or scratch)
        runs = {}
        for name in VARIANTS:
            model = model_of(name, args.model_name_or_path)
            wall_s = launch(name, model, runs_dir / name, args.max_eval_samples)
            shape = memory_model.shape_from_model(model)
            runs[name] = {**measure(name, runs_dir / name, shape), "model": model, "wall_s": round(wall_s, 1)}
            reads = ", ".join(f"{module} {n}" for module, n in runs[name]["host_reads_per_step"].items())
            calls = ", ".join(f"{kind} {c['calls']}" for kind, c in runs[name]["collectives_per_step"].items())
            print(f"{name}: model state measured / predicted {runs[name]['memory']['ratio']:.3f}; per step on rank 0, "
                  f"host reads: {reads}; collectives: {calls} ({wall_s:.0f} s)", flush=True)
    hw = hardware()
    result = {"kind": "deepspeed", "date": str(dt.date.today()),
              "command": shlex.join(["python", "scripts/measure/deepspeed_record.py", *(argv if argv is not None
                                                                                 else sys.argv[1:])]),
              "model": args.model_name_or_path, "world_size": WORLD, "precision": PRECISION,
              "optimizer_steps": STEPS, "per_device_train_batch_size": MICRO_BATCH,
              "max_eval_samples": args.max_eval_samples, "counted_steps": list(COMM_STEPS), "runs": runs,
              "duration_s": round(time.perf_counter() - start, 1), "hardware": hw, "versions": library_versions()}
    path = results_path("deepspeed", hw, args.results_dir)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path} ({result['duration_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
