"""`make bench BENCH=predict`: batch prediction's speed and int8's cost on `make demo-pretrained`'s model, side by side.

    python scripts/bench_predict.py                 # 5 rounds over the 1,143 eval snippets; about 10 min on 2 cores

Four sides, in one process, taking turns in every round (the order rotates from round to round), each over the same
rows (artifacts/rotten_tomatoes/eval.csv) at the same batch size and threads:
- `pipeline`: `pipeline("text-classification", truncation=True)` on final/ in fp32, the texts already in memory;
- `pytorch`: recipes/predict.py on final/ (file read by windows, length-sorted batches, predictions.jsonl written);
- `onnx`: recipes/predict.py on the export's model.onnx (ONNX Runtime);
- `onnx_int8`: the same on model.int8.onnx.
A side's figure is rows per second of its prediction (the model loaded beforehand); the ratios are taken per round
and summarised by their median, min and max. Each pass records its CPU share and the share of the machine's CPU that
other work took meanwhile (scripts/bench_load.py): a pass with others above OTHERS_CEILING is marked disturbed. The
export (with --int8) is made first when the run has none. Results: results/<date>_predict_<device>_<host>.{json,md}.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from recipes import export, predict
from recipes.serving import classifier, runtime
from scripts import bench_load
from scripts.bench import hardware
from scripts.bench_report import slug, unused_stem
from scripts.demo_pretrained import DEMO_LR

REPO = Path(__file__).resolve().parent.parent
DEMO_RUN = REPO / "runs" / "demo-pretrained" / "pretrained" / f"lr{DEMO_LR:g}_seed42" / "run"
SIDES = ("pipeline", "pytorch", "onnx", "onnx_int8")
# goal name -> (numerator side, denominator side, the ratio it must reach)
GOALS = {"onnx_vs_pipeline": ("onnx", "pipeline", 2.0), "pytorch_vs_pipeline": ("pytorch", "pipeline", 1.0),
         "int8_vs_onnx": ("onnx_int8", "onnx", 1.5)}
MAX_DROP_POINTS = 0.5  # int8's accuracy may fall this much below fp32's


class Sides:
    """Each side's pass over the rows: (rows per second, its predicted labels)."""

    def __init__(self, run: Path, rows: str, batch_size: int, threads: int, scratch: Path):
        from transformers import pipeline

        self.run, self.rows, self.batch_size, self.threads, self.scratch = run, rows, batch_size, threads, scratch
        with open(rows, newline="") as f:
            self.texts = [r["text"] for r in csv.DictReader(f)]
        torch.set_num_threads(threads)
        self.pipe = pipeline("text-classification", model=str(run / "final"), device=-1, dtype=torch.float32)

    def pipeline(self):
        start = time.perf_counter()
        out = self.pipe(self.texts, batch_size=self.batch_size, truncation=True)
        return len(self.texts) / (time.perf_counter() - start), [o["label"] for o in out]

    def predict(self, folder: Path, onnx_file=None):
        target = self.scratch / "predictions"
        shutil.rmtree(target, ignore_errors=True)
        argv = ["--model_dir", str(folder), "--predict_file", self.rows, "--output_dir", str(target),
                "--batch_size", str(self.batch_size), "--threads", str(self.threads)]
        record = predict.main(predict.parse_config(argv + (["--onnx_file", onnx_file] if onnx_file else [])))
        labels = [json.loads(line)["prediction"] for line in open(target / "predictions.jsonl")]
        return record["rows_per_s"], labels

    def run_side(self, side: str):
        if side == "pipeline":
            return self.pipeline()
        if side == "pytorch":
            return self.predict(self.run)
        return self.predict(self.run / "onnx", classifier.INT8_FILE if side == "onnx_int8" else None)


def measured(sides: Sides, side: str) -> tuple[dict, list]:
    """One pass of `side` with its CPU figures."""
    machine, own, load = bench_load.machine_cpu(), time.process_time(), os.getloadavg()[0]
    rows_per_s, labels = sides.run_side(side)
    after, own_after = bench_load.machine_cpu(), time.process_time()
    figures = {"side": side, "rows_per_s": rows_per_s, "load_before": load, "load_after": os.getloadavg()[0]}
    if machine and after:
        busy, total, mine = after[0] - machine[0], after[1] - machine[1], own_after - own
        figures["others_share"] = max(0.0, busy - mine) / total if total > 0 else None
        figures["disturbed"] = figures["others_share"] is not None and \
            figures["others_share"] > bench_load.OTHERS_CEILING
    return figures, labels


def spread(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", type=Path, default=DEMO_RUN, help="a run's --output_dir (default: make "
                        "demo-pretrained's seed 42)")
    parser.add_argument("--predict_file", default=str(REPO / "artifacts" / "rotten_tomatoes" / "eval.csv"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="default: the cores this process may use")
    parser.add_argument("--results_dir", type=Path, default=REPO / "results")
    args = parser.parse_args(argv)
    if not (args.run_dir / "final" / "config.json").is_file():
        sys.exit(f"error: {args.run_dir} holds no final/: run `make demo-pretrained` first (or give --run_dir)")
    if not (args.run_dir / "onnx" / classifier.INT8_FILE).is_file():
        export.main(export.parse_config(["--run_dir", str(args.run_dir), "--int8", "--overwrite_output_dir"]))
    threads = runtime.cpu_threads(args.threads)
    scratch = REPO / "runs" / "bench_predict"
    sides = Sides(args.run_dir, args.predict_file, args.batch_size, threads, scratch)
    with open(args.predict_file, newline="") as f:
        truth = [r["label"] for r in csv.DictReader(f)]
    passes, accuracy = [], {}
    for round_ in range(args.rounds):
        order = SIDES[round_ % len(SIDES):] + SIDES[:round_ % len(SIDES)]
        for side in order:
            figures, labels = measured(sides, side)
            accuracy[side] = sum(a == b for a, b in zip(labels, truth)) / len(truth)
            passes.append({"round": round_, **figures})
            print(f"round {round_} {side}: {figures['rows_per_s']:.1f} rows/s, others' CPU share "
                  f"{figures.get('others_share', float('nan')):.2f}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    speed = {side: [p["rows_per_s"] for p in passes if p["side"] == side] for side in SIDES}
    ratios = {name: spread([a / b for a, b in zip(speed[top], speed[bottom])]) for name, (top, bottom, _) in
              GOALS.items()}
    drop = 100 * (accuracy["onnx"] - accuracy["onnx_int8"])
    record = json.loads((args.run_dir / "onnx" / classifier.EXPORT_RECORD).read_text())
    hw = hardware()
    result = {"date": str(dt.date.today()), "command": "make bench BENCH=predict" if argv is None else
              " ".join(["python scripts/bench_predict.py", *argv]), "hardware": hw, "versions": runtime.versions(),
              "model": str(args.run_dir / "final"), "rows": len(truth), "rows_file": args.predict_file,
              "batch_size": args.batch_size, "threads": threads, "rounds": args.rounds,
              "sides": {side: {**spread(values), "accuracy": accuracy[side]} for side, values in speed.items()},
              "ratios": ratios, "int8": {"accuracy_fp32": accuracy["onnx"], "accuracy_int8": accuracy["onnx_int8"],
                                         "drop_points": drop},
              "goals": {**{name: ratios[name]["median"] >= goal for name, (_, _, goal) in GOALS.items()},
                        "int8_drop": drop <= MAX_DROP_POINTS},
              "disturbed_passes": sum(bool(p.get("disturbed")) for p in passes), "passes": passes,
              "export_parity": {k: record["parity"][k] for k in ("data", "examples", "max_abs_logit_difference",
                                                                 "near_ties", "decisions_differing")},
              "export_int8": {k: record["int8"][k] for k in ("scores", "drop_points", "speedup", "batch_size")}}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / unused_stem(args.results_dir, f"{result['date']}_predict_{slug(hw['device'])}_"
                                                           f"{slug(hw['host'])}")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(stem.with_suffix(".md").read_text())
    return 0


def markdown(result: dict) -> str:
    sides, ratios, parity, int8 = result["sides"], result["ratios"], result["export_parity"], result["int8"]
    goal = {True: "met", False: "not met"}
    lines = [f"# Batch prediction on {result['hardware']['device']} ({result['date']}, {result['threads']} threads, "
             f"batch {result['batch_size']})", "",
             f"`{result['command']}`: {result['model']} over the {result['rows']:,} rows of {result['rows_file']}, "
             f"{result['rounds']} rounds, the four sides taking turns in each (scripts/bench_predict.py).", "",
             "| side | rows/s, median | min | max | accuracy |", "|---|--:|--:|--:|--:|",
             *(f"| {name} | {s['median']:.1f} | {s['min']:.1f} | {s['max']:.1f} | {s['accuracy']:.4f} |"
               for name, s in sides.items()), "",
             "| ratio, per round | median | min | max | goal | |", "|---|--:|--:|--:|--:|---|",
             *(f"| {name} | {r['median']:.3f} | {r['min']:.3f} | {r['max']:.3f} | >= {GOALS[name][2]:g} | "
               f"{goal[result['goals'][name]]} |" for name, r in ratios.items()), "",
             f"int8 accuracy {int8['accuracy_int8']:.4f} against fp32's {int8['accuracy_fp32']:.4f}: "
             f"{int8['drop_points']:.2f} points lower (goal <= {MAX_DROP_POINTS} points: "
             f"{goal[result['goals']['int8_drop']]}).", "",
             f"Export parity (recipes/export.py on the same model, {parity['data']}): max |logit difference| "
             f"{parity['max_abs_logit_difference']:.2e} over {parity['examples']:,} rows, {parity['near_ties']} "
             f"near-ties, {parity['decisions_differing']} decisions differing.", "",
             f"Other work on the machine: {result['disturbed_passes']} of {len(result['passes'])} passes had others "
             f"above {bench_load.OTHERS_CEILING:.2f} of the machine's CPU (scripts/bench_load.py).", "",
             "| round | side | rows/s | others' CPU share | load average before |", "|--:|---|--:|--:|--:|",
             *(f"| {p['round']} | {p['side']} | {p['rows_per_s']:.1f} | {p.get('others_share', float('nan')):.2f} | "
               f"{p['load_before']:.2f} |" for p in result["passes"]), "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
