"""A dated record of a finished run, for the figures the docs quote (`make demo` and `make pairs` write one).

    python scripts/measure/run_record.py demo runs/demo     # -> results/<date>_demo_<device>_<host>.json

The record holds the run's last evaluation (eval.jsonl), its optimizer steps, world size, precision and flags
(run_config.json), the machine and the library versions; tests/test_docs.py holds the figures README.md and
docs/data.md quote to the newest record of each kind.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from recipes.outputs.records import library_versions, read_jsonl
from scripts.measure.bench import REPO, hardware
from scripts.measure.bench_report import slug


def results_path(kind: str, hw: dict, results_dir: Path = REPO / "results") -> Path:
    """results/<date>_<kind>_<device>_<host>.json, the name the docs test looks records up by."""
    return Path(results_dir) / f"{dt.date.today()}_{kind}_{slug(hw['device'])}_{slug(hw['host'])}.json"


def record(kind: str, run_dir: Path, command: str) -> dict:
    run_config = json.loads((run_dir / "run_config.json").read_text())
    evaluations = read_jsonl(run_dir / "eval.jsonl")
    if not evaluations:
        raise SystemExit(f"error: {run_dir} has no evaluation (eval.jsonl): nothing to record")
    steps = read_jsonl(run_dir / "metrics.jsonl")
    return {"kind": kind, "date": str(dt.date.today()), "command": command, "run_dir": str(run_dir),
            "eval": evaluations[-1], "optimizer_steps": steps[-1]["step"] if steps else 0,
            "world_size": run_config["world_size"], "mixed_precision": run_config["mixed_precision"],
            "n_train_examples": run_config["n_train_examples"], "n_eval_examples": run_config["n_eval_examples"],
            "flags": run_config["config"], "hardware": hardware(), "versions": library_versions()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", help="the record's name in results/: demo, pairs, ...")
    parser.add_argument("run_dir", help="the run's --output_dir")
    parser.add_argument("--command", default="", help="the command that made the run (the Makefile passes its target)")
    parser.add_argument("--results_dir", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    result = record(args.kind, Path(args.run_dir), args.command)
    path = results_path(args.kind, result["hardware"], args.results_dir)
    path.write_text(json.dumps(result, indent=2) + "\n")
    scores = ", ".join(f"{k} {v:.4f}" for k, v in result["eval"].items() if k in ("accuracy", "f1_macro"))
    print(f"wrote {path}: {scores} on {result['eval']['n_examples']} examples after {result['optimizer_steps']} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
