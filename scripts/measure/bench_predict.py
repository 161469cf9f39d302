"""`make bench BENCH=predict`: batch prediction's speed and int8's cost on `make demo-pretrained`'s model, side by side.

    python scripts/measure/bench_predict.py                 # 6 rounds over the 1,143 eval snippets; about 15 min on 2 cores

Four sides, in one process, taking turns in every round (the order rotates from round to round), each over the same
rows (artifacts/rotten_tomatoes/eval.csv) at the same batch size and threads:
- `pipeline`: `pipeline("text-classification", truncation=True)` on final/ in fp32, the texts already in memory;
- `pytorch`: recipes/predict.py on final/ (file read by windows, length-sorted batches, predictions.jsonl written);
- `onnx`: recipes/predict.py on the export's model.onnx (ONNX Runtime);
- `onnx_int8`: the same on model.int8.onnx.
Each round runs the four at every thread count of --threads (default: 1 and the cores this process may use). A side's
figure is rows per second of its prediction, the model loaded beforehand; the ratios are taken per round and
summarised by their median, min and max. Each pass also records its process's CPU seconds and the share of the
machine's CPU that other work took meanwhile (scripts/measure/bench_load.py): a round with a pass whose others' share is above
OTHERS_CEILING is disturbed, and the ratios are given over the undisturbed rounds too. Rows per CPU second (one
thread) hardly move when other work takes cores, wall rows per second do. The export (with --int8) is made first
when the run has none. Results: results/<date>_predict_<device>_<host>.{json,md}.
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
from scripts.measure import bench_load
from scripts.measure.bench import hardware
from scripts.measure.bench_report import slug, unused_stem
from scripts.demo_pretrained import DEMO_LR

REPO = Path(__file__).resolve().parents[2]
DEMO_RUN = REPO / "runs" / "demo-pretrained" / "pretrained" / f"lr{DEMO_LR:g}_seed42" / "run"
SIDES = ("pipeline", "pytorch", "onnx", "onnx_int8")
# ratio name -> (numerator side, denominator side, the goal it must reach, None: no goal)
GOALS = {"onnx_vs_pipeline": ("onnx", "pipeline", 2.0), "pytorch_vs_pipeline": ("pytorch", "pipeline", 1.0),
         "int8_vs_onnx": ("onnx_int8", "onnx", 1.5), "int8_vs_pipeline": ("onnx_int8", "pipeline", None)}
MAX_DROP_POINTS = 0.5  # int8's accuracy may fall this much below fp32's


class Sides:
    """Each side's pass over the rows: (rows per second, its predicted labels)."""

    def __init__(self, run: Path, rows: str, batch_size: int, scratch: Path):
        from transformers import pipeline

        self.run, self.rows, self.batch_size, self.scratch = run, rows, batch_size, scratch
        with open(rows, newline="") as f:
            self.texts = [r["text"] for r in csv.DictReader(f)]
        self.pipe = pipeline("text-classification", model=str(run / "final"), device=-1, dtype=torch.float32)

    def pipeline(self, threads: int):
        torch.set_num_threads(threads)
        start = time.perf_counter()
        out = self.pipe(self.texts, batch_size=self.batch_size, truncation=True)
        return len(self.texts) / (time.perf_counter() - start), [o["label"] for o in out]

    def predict(self, threads: int, folder: Path, onnx_file=None):
        target = self.scratch / "predictions"
        shutil.rmtree(target, ignore_errors=True)
        argv = ["--model_dir", str(folder), "--predict_file", self.rows, "--output_dir", str(target),
                "--batch_size", str(self.batch_size), "--threads", str(threads)]
        record = predict.main(predict.parse_config(argv + (["--onnx_file", onnx_file] if onnx_file else [])))
        labels = [json.loads(line)["prediction"] for line in open(target / "predictions.jsonl")]
        return record["rows_per_s"], labels

    def run_side(self, side: str, threads: int):
        if side == "pipeline":
            return self.pipeline(threads)
        if side == "pytorch":
            return self.predict(threads, self.run)
        return self.predict(threads, self.run / "onnx", classifier.INT8_FILE if side == "onnx_int8" else None)


def measured(sides: Sides, side: str, threads: int) -> tuple[dict, list]:
    """One pass of `side` with its CPU figures."""
    machine, own, load = bench_load.machine_cpu(), time.process_time(), os.getloadavg()[0]
    rows_per_s, labels = sides.run_side(side, threads)
    after, cpu = bench_load.machine_cpu(), time.process_time() - own
    figures = {"side": side, "threads": threads, "rows_per_s": rows_per_s, "cpu_s": cpu, "load_before": load}
    if machine and after:
        busy, total = after[0] - machine[0], after[1] - machine[1]
        figures["others_share"] = max(0.0, busy - cpu) / total if total > 0 else None
    figures["disturbed"] = (figures.get("others_share") or 0.0) > bench_load.OTHERS_CEILING
    return figures, labels


def rerender(path: Path) -> int:
    result = json.loads(path.read_text())
    result["by_threads"] = [summarise(result["passes"], t, result["rows"]) for t in
                            sorted({p["threads"] for p in result["passes"]})]
    path.write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(result))
    print(path.with_suffix(".md").read_text())
    return 0


def relative(path) -> str:
    """A path inside the checkout as the repository names it; others as given."""
    path = Path(os.path.abspath(path))  # not resolved: artifacts/ may be a link out of the checkout
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def spread(values: list) -> dict:
    if not values:
        return {"rounds": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": len(values)}


def summarise(passes: list, threads: int, rows: int) -> dict:
    """Per side and per ratio at `threads`: over every round, and over the undisturbed ones."""
    mine = [p for p in passes if p["threads"] == threads]
    rounds = sorted({p["round"] for p in mine})
    quiet = [r for r in rounds if not any(p["disturbed"] for p in mine if p["round"] == r)]
    speed = {(p["round"], p["side"]): p["rows_per_s"] for p in mine}
    per_cpu = {(p["round"], p["side"]): rows / p["cpu_s"] for p in mine}
    summary = {"threads": threads, "undisturbed_rounds": quiet, "sides": {}, "ratios": {}}
    for side in SIDES:
        summary["sides"][side] = {"rows_per_s": spread([speed[r, side] for r in rounds]),
                                  "rows_per_s_undisturbed": spread([speed[r, side] for r in quiet]),
                                  "rows_per_cpu_s": spread([per_cpu[r, side] for r in rounds])}
    for name, (top, bottom, _) in GOALS.items():
        summary["ratios"][name] = {
            "all": spread([speed[r, top] / speed[r, bottom] for r in rounds]),
            "undisturbed": spread([speed[r, top] / speed[r, bottom] for r in quiet]),
            "per_cpu_s": spread([per_cpu[r, top] / per_cpu[r, bottom] for r in rounds])}
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run_dir", type=Path, default=DEMO_RUN, help="a run's --output_dir (default: make "
                        "demo-pretrained's seed 42)")
    parser.add_argument("--predict_file", default=str(REPO / "artifacts" / "rotten_tomatoes" / "eval.csv"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", help="thread counts (default: 1 and the cores)")
    parser.add_argument("--results_dir", type=Path, default=REPO / "results")
    parser.add_argument("--rerender", type=Path, help="a results .json: its summaries and .md again from its passes")
    args = parser.parse_args(argv)
    if args.rerender:
        return rerender(args.rerender)
    if not (args.run_dir / "final" / "config.json").is_file():
        sys.exit(f"error: {args.run_dir} holds no final/: run `make demo-pretrained` first (or give --run_dir)")
    if not (args.run_dir / "onnx" / classifier.INT8_FILE).is_file():
        export.main(export.parse_config(["--run_dir", str(args.run_dir), "--int8", "--overwrite_output_dir"]))
    thread_counts = args.threads or sorted({1, runtime.cpu_threads()})
    scratch = REPO / "runs" / "bench_predict"
    sides = Sides(args.run_dir, args.predict_file, args.batch_size, scratch)
    with open(args.predict_file, newline="") as f:
        truth = [r["label"] for r in csv.DictReader(f)]
    passes, accuracy = [], {}
    for round_ in range(args.rounds):
        order = SIDES[round_ % len(SIDES):] + SIDES[:round_ % len(SIDES)]
        for threads in thread_counts:
            for side in order:
                figures, labels = measured(sides, side, threads)
                accuracy[side] = sum(a == b for a, b in zip(labels, truth)) / len(truth)
                passes.append({"round": round_, **figures})
                print(f"round {round_}, {threads} thread(s), {side}: {figures['rows_per_s']:.1f} rows/s, others' "
                      f"CPU share {figures.get('others_share') or 0:.2f}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    drop = 100 * (accuracy["onnx"] - accuracy["onnx_int8"])
    record = json.loads((args.run_dir / "onnx" / classifier.EXPORT_RECORD).read_text())
    hw = hardware()
    result = {"date": str(dt.date.today()), "command": "make bench BENCH=predict" if argv is None else
              " ".join(["python scripts/measure/bench_predict.py", *argv]), "hardware": hw, "versions": runtime.versions(),
              "model": relative(args.run_dir / "final"), "rows": len(truth), "rows_file": relative(args.predict_file),
              "batch_size": args.batch_size, "rounds": args.rounds, "accuracy": accuracy,
              "by_threads": [summarise(passes, t, len(truth)) for t in thread_counts],
              "int8": {"accuracy_fp32": accuracy["onnx"], "accuracy_int8": accuracy["onnx_int8"], "drop_points": drop,
                       "goal_met": drop <= MAX_DROP_POINTS},
              "passes": passes,
              "export_parity": {**{k: record["parity"][k] for k in ("examples", "max_abs_logit_difference",
                                                                    "near_ties", "decisions_differing")},
                                "data": record["parity"]["data"].replace(f"{REPO}/", "")}}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / unused_stem(args.results_dir, f"{result['date']}_predict_{slug(hw['device'])}_"
                                                           f"{slug(hw['host'])}")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(stem.with_suffix(".md").read_text())
    return 0


def goal_cell(goal) -> str:
    return "-" if goal is None else f">= {goal:g}"


def cell(entry: dict, digits: int = 3) -> str:
    if not entry.get("rounds"):
        return "-"
    return f"{entry['median']:.{digits}f} ({entry['min']:.{digits}f}-{entry['max']:.{digits}f})"


def page_lines(result: dict) -> list[str]:
    """What docs/export.md quotes of a results file (tests/test_export.py holds the page to the latest one)."""
    names = {"pipeline": "pipeline()", "pytorch": "PyTorch path", "onnx": "ONNX Runtime", "onnx_int8": "int8"}
    lines = ["| threads | " + " | ".join(f"{names[s]} rows/s" for s in SIDES) + " | ONNX / pipeline() | "
             "PyTorch / pipeline() | int8 / fp32 | int8 / pipeline() |", "|--:|" + "--:|" * (len(SIDES) + len(GOALS))]
    for summary in result["by_threads"]:
        lines.append(f"| {summary['threads']} | " + " | ".join(f"{summary['sides'][s]['rows_per_s']['median']:.1f}"
                                                               for s in SIDES) + " | "
                     + " | ".join(cell(summary["ratios"][name]["all"]) for name in GOALS) + " |")
    one = next((summary for summary in result["by_threads"] if summary["threads"] == 1), None)
    if one:
        labels = {"onnx_vs_pipeline": "ONNX / pipeline()", "pytorch_vs_pipeline": "PyTorch / pipeline()",
                  "int8_vs_onnx": "int8 / fp32", "int8_vs_pipeline": "int8 / pipeline()"}
        lines.append("Rows per CPU second at one thread: " + ", ".join(
            f"{labels[name]} {cell(one['ratios'][name]['per_cpu_s'])}" for name in GOALS) + ".")
    int8 = result["int8"]
    lines.append(f"int8 accuracy {int8['accuracy_int8']:.4f} against fp32's {int8['accuracy_fp32']:.4f}: "
                 f"{int8['drop_points']:.2f} points lower.")
    return lines


def markdown(result: dict) -> str:
    parity, int8 = result["export_parity"], result["int8"]
    lines = [f"# Batch prediction on {result['hardware']['device']} ({result['date']}, "
             f"{result['hardware']['cpu_cores']} cores, batch {result['batch_size']})", "",
             f"`{result['command']}`: {result['model']} over the {result['rows']:,} rows of {result['rows_file']}, "
             f"{result['rounds']} rounds, the four sides taking turns in each at each thread count "
             "(scripts/measure/bench_predict.py). Figures: median (min-max) over the rounds.", ""]
    for summary in result["by_threads"]:
        t, quiet = summary["threads"], summary["undisturbed_rounds"]
        lines += [f"## {t} thread{'s' if t > 1 else ''}", "",
                  "| side | rows/s | rows/s, undisturbed rounds | rows per CPU second | accuracy |",
                  "|---|--:|--:|--:|--:|",
                  *(f"| {side} | {cell(s['rows_per_s'], 1)} | {cell(s['rows_per_s_undisturbed'], 1)} | "
                    f"{cell(s['rows_per_cpu_s'], 1)} | {result['accuracy'][side]:.4f} |"
                    for side, s in summary["sides"].items()), "",
                  "| ratio | goal | per round | undisturbed rounds | per CPU second |", "|---|--:|--:|--:|--:|",
                  *(f"| {name} | {goal_cell(GOALS[name][2])} | {cell(r['all'])} | {cell(r['undisturbed'])} | "
                    f"{cell(r['per_cpu_s'])} |" for name, r in summary["ratios"].items()), "",
                  f"Undisturbed rounds (every pass with others below {bench_load.OTHERS_CEILING:.2f} of the machine's "
                  f"CPU): {len(quiet)} of {result['rounds']}.", ""]
    if not any(summary["undisturbed_rounds"] for summary in result["by_threads"]):
        lines += ["**Every round was disturbed**: other work took part of the machine's CPU during each (the passes' "
                  "others' share below). Wall rows/s then depend on when a pass ran; rows per CPU second (one "
                  "thread: the process's CPU seconds are its work) hardly move, and their ratios are the ones to "
                  "read. With two threads, CPU seconds also count the threads' waits for each other.", ""]
    lines += [*(line for note in result.get("notes", []) for line in (note, "")),
              f"int8 accuracy {int8['accuracy_int8']:.4f} against fp32's {int8['accuracy_fp32']:.4f}: "
              f"{int8['drop_points']:.2f} points lower (goal <= {MAX_DROP_POINTS} points: "
              f"{'met' if int8['goal_met'] else 'not met'}).", "",
              f"Export parity (recipes/export.py on the same model, {parity['data']}): max |logit difference| "
              f"{parity['max_abs_logit_difference']:.2e} over {parity['examples']:,} rows, {parity['near_ties']} "
              f"near-ties, {parity['decisions_differing']} decisions differing.", "",
              "## Passes", "", "| round | threads | side | rows/s | CPU s | others' CPU share | load before |",
              "|--:|--:|---|--:|--:|--:|--:|",
              *(f"| {p['round']} | {p['threads']} | {p['side']} | {p['rows_per_s']:.1f} | {p['cpu_s']:.1f} | "
                f"{p.get('others_share') or 0:.2f} | {p['load_before']:.2f} |" for p in result["passes"]), "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
