"""make demo-decoder: a real decoder LLM as a classifier, offline: SmolLM2-135M-Instruct with LoRA on Rotten Tomatoes.

    make demo-decoder                       # one seed, DDP on 2 processes
    make demo-decoder SEEDS="42 43 44"      # the three seeds the docs quote
    python scripts/demo_decoder.py --choose_lr 5e-4 1e-3 2e-3    # the learning rate, on the validation split
    python scripts/demo_decoder.py --random_init                 # the same architecture from random init, in full

The model is SmolLM2-135M-Instruct staged by `make fetch-smollm2` (artifacts/smollm2: the 4-bit-rounded weights of
a GGUF file, dequantized to fp32, not the original bf16 release), the data the Rotten Tomatoes snippets of
`make fetch-pretrained`, split by movie. Each run is the recipe, `accelerate launch --config_file
accelerate_configs/ddp.yaml recipes/cls.py`, LoRA r 8 on every linear layer of the 30 decoder layers and `score` in
full (--use_peft), for STEPS optimizer steps of 2 x 8 snippets cut at 64 tokens (less than an epoch: the budget is 20
minutes a seed on 2 idle cores), scored on eval.csv, or with --choose_lr on validation.csv with an evaluation every
EVAL_EVERY steps (the learning curve). The random-init arm trains the same architecture in full (LoRA on random
weights is refused) at RANDOM_INIT_LR for the same steps.

Each invocation writes results/<date>_<kind>_<device>_<host>.{json,md}, kind `decoder`, `decoder_lr` or
`decoder_random_init`: every run's seed, learning rate, accuracy, its evaluations (the learning curve), wall and CPU
seconds, the machine's load and the share of its CPU that other work took (scripts/measure/bench_load.py), and the goal:
mean eval accuracy >= GOAL over the seeds, each within GOAL_MINUTES on the idle machine (wall minutes; a machine
shared with other work is judged by its CPU seconds over its 2 cores, which the record gives too).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
from pathlib import Path
from statistics import mean

from recipes import RecipeError
from recipes.outputs.records import read_jsonl
from scripts.measure.bench import ACCELERATE, free_port, hardware
from scripts.measure.bench_report import slug
from scripts.demo_pretrained import latest_record, launch_metered, relative, versions
from scripts.fetch_pretrained import DEFAULT_DATA_DIR
from scripts.fetch_smollm2 import DEFAULT_DIR as DEFAULT_MODEL_DIR
from scripts.fetch_smollm2 import check_staged

REPO = Path(__file__).resolve().parent.parent
DEMO_LR = 1e-3  # chosen by --choose_lr on the validation split (results/2026-11-29_decoder_lr_cpu_vm.md; a test holds it)
RANDOM_INIT_LR = 1e-3
LORA_R = 8
STEPS = 400
EVAL_EVERY = 100  # --choose_lr: the learning curve on the validation split
GOAL, GOAL_MINUTES = 0.80, 20
RUN_FLAGS = ["--text_column", "text", "--label_column", "label", "--max_length", "64",
             "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "32", "--group_by_length"]


def run_once(args, split: str, lr: float, seed: int, start: list[str], run_dir: Path, every: int | None) -> dict:
    """One launch of the recipe; its scores, its evaluations, time and the machine's load around it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = [ACCELERATE, "launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes",
               str(args.procs), "--main_process_port", str(free_port()), "recipes/cls.py", "--model_name_or_path",
               str(args.model_dir), *start, "--train_file", str(args.data_dir / "train.csv"), "--validation_file",
               str(args.data_dir / f"{split}.csv"), *RUN_FLAGS, "--max_train_steps", str(args.steps),
               *(["--eval_steps", str(every)] if every else []), "--learning_rate", str(lr), "--seed", str(seed),
               "--output_dir", str(run_dir / "run")]
    measured = launch_metered(command, run_dir, f"seed {seed}, learning rate {lr:g}")
    evals = read_jsonl(run_dir / "run" / "eval.jsonl")
    steps = read_jsonl(run_dir / "run" / "metrics.jsonl")
    result = {"seed": seed, "learning_rate": lr, "accuracy": evals[-1]["accuracy"], "f1_macro": evals[-1]["f1_macro"],
              "n_examples": evals[-1]["n_examples"], "steps": evals[-1]["step"],
              "curve": [{"step": e["step"], "accuracy": e["accuracy"], "loss": round(e["loss"], 4)} for e in evals],
              "train_s": round(steps[-1]["elapsed"], 1), **measured}
    print(f"seed {seed}, learning rate {lr:g}: {split} accuracy {result['accuracy']:.4f} on {result['n_examples']} "
          f"snippets, {result['wall_s'] / 60:.1f} min ({result['cpu_s']:.0f} CPU s)", flush=True)
    return result


def latest(results_dir: Path, kind: str, files=None) -> tuple[Path, dict] | None:
    """The newest record of `kind` (<date>_<kind>_<device>_<host>.json) in results_dir, or among `files`."""
    return latest_record(results_dir, kind, KINDS, files)


KINDS = ("decoder", "decoder_lr", "decoder_random_init")


def summarise(runs: list, kind: str, results_dir: Path, procs: int) -> dict:
    accuracies = [r["accuracy"] for r in runs]
    summary = {"mean_accuracy": round(mean(accuracies), 4), "min_accuracy": min(accuracies),
               "max_accuracy": max(accuracies), "max_minutes": round(max(r["wall_s"] for r in runs) / 60, 1),
               "max_cpu_minutes_per_core": round(max(r["cpu_s"] for r in runs) / 60 / procs, 1)}
    if kind == "decoder_lr":  # the best learning rate by mean validation accuracy over its seeds
        by_lr = {}
        for r in runs:
            by_lr.setdefault(r["learning_rate"], []).append(r["accuracy"])
        summary["validation_accuracy_by_lr"] = {f"{lr:g}": round(mean(a), 4) for lr, a in by_lr.items()}
        summary["chosen_learning_rate"] = max(by_lr, key=lambda lr: mean(by_lr[lr]))
    if kind == "decoder":
        summary["goal"] = {"accuracy": GOAL, "minutes": GOAL_MINUTES,
                           "accuracy_met": summary["mean_accuracy"] >= GOAL,
                           "minutes_met_by_wall": summary["max_minutes"] <= GOAL_MINUTES,
                           "minutes_met_by_cpu": summary["max_cpu_minutes_per_core"] <= GOAL_MINUTES}
        found = latest(results_dir, "decoder_random_init")
        summary["random_init"] = None if found is None else {
            "record": found[0].stem, "mean_accuracy": found[1]["mean_accuracy"], "seeds": len(found[1]["runs"]),
            "learning_rates": sorted({r["learning_rate"] for r in found[1]["runs"]})}
    return summary


def render_markdown(record: dict) -> str:
    kind, split = record["kind"], "validation" if record["kind"] == "decoder_lr" else "eval"
    start = "random init, every weight trained (--random_init)" if kind == "decoder_random_init" else \
        f"the staged weights (4-bit-rounded, not the original bf16), frozen, LoRA `{' '.join(record['start_flags'])}`" \
        " and `score` trained"
    data, hw = record["data"], record["hardware"]
    seen = record["steps"] * record["procs"] * 8
    lines = [f"# {kind} {record['date']}: SmolLM2-135M-Instruct as a classifier on Rotten Tomatoes, scored on {split}",
             "", f"`{record['command']}`", "",
             f"Model: {record['model']['path']} (SHA-256 of model.safetensors {record['model']['sha256'][:12]}...), "
             f"from {start}. Data: {data['train']['rows']:,} training snippets, scored on the {split} split's "
             f"{data[split]['rows']:,} ({data[split]['fresh_share']:.4f} fresh), split by movie. Each run: DDP on "
             f"{record['procs']} processes, {record['steps']} steps of {record['procs']} x 8 snippets "
             f"({seen:,} snippets, {seen / data['train']['rows']:.2f} of an epoch), `{' '.join(RUN_FLAGS)}`.", "",
             "| seed | learning rate | accuracy | macro-F1 | examples | steps | training s | minutes | CPU s | load "
             "before / after | others' CPU share |", "|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|"]
    for r in record["runs"]:
        lines.append(f"| {r['seed']} | {r['learning_rate']:g} | {r['accuracy']:.4f} | {r['f1_macro']:.4f} | "
                     f"{r['n_examples']} | {r['steps']} | {r['train_s']:.0f} | {r['wall_s'] / 60:.1f} | "
                     f"{r['cpu_s']:.0f} | {r['loadavg_before'][0]:.2f} / {r['loadavg_after'][0]:.2f} | "
                     f"{r['others_share']:.3f} |")
    lines += ["", f"Mean {split} accuracy over {len(record['runs'])} run(s): **{record['mean_accuracy']:.4f}** (min "
                  f"{record['min_accuracy']:.4f}, max {record['max_accuracy']:.4f}); the longest run "
                  f"{record['max_minutes']} min of wall time, {record['max_cpu_minutes_per_core']} CPU minutes per "
                  "core."]
    curves = [r for r in record["runs"] if len(r["curve"]) > 1]
    if curves:
        lines += ["", "Learning curve (accuracy at each evaluation):", "",
                  "| learning rate | seed | " + " | ".join(f"step {c['step']}" for c in curves[0]["curve"]) + " |",
                  "|--:|--:|" + "--:|" * len(curves[0]["curve"])]
        for r in curves:
            lines.append(f"| {r['learning_rate']:g} | {r['seed']} | "
                         + " | ".join(f"{c['accuracy']:.4f}" for c in r["curve"]) + " |")
    if "chosen_learning_rate" in record:
        scores = ", ".join(f"{lr}: {acc:.4f}" for lr, acc in record["validation_accuracy_by_lr"].items())
        lines.append(f"\nValidation accuracy by learning rate: {scores}; chosen: "
                     f"**{record['chosen_learning_rate']:g}**.")
    if record.get("goal"):
        g = record["goal"]
        lines.append(f"\nGoal: mean eval accuracy >= {g['accuracy']} over the seeds, each run within {g['minutes']} "
                     f"minutes on 2 idle cores. Accuracy: {'met' if g['accuracy_met'] else 'not met'}. Time: "
                     f"{'met' if g['minutes_met_by_wall'] else 'not met'} by wall time on this machine (shared: "
                     f"see the load columns), {'met' if g['minutes_met_by_cpu'] else 'not met'} by CPU seconds over "
                     f"{record['procs']} cores.")
    if record.get("random_init"):
        ri = record["random_init"]
        lines.append(f"\nThe same architecture from random init, in full ([{ri['record']}]({ri['record']}.md), not "
                     f"trained again here): {ri['mean_accuracy']:.4f} over {ri['seeds']} seed(s).")
    lines += ["", f"Hardware: {hw['cpu']}, {hw['cpu_cores']} cores, {hw.get('memory_gib', '?')} GiB. Versions: "
                  + ", ".join(f"{k} {val}" for k, val in record["versions"].items()) + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="one run per seed (default: 42)")
    parser.add_argument("--learning_rate", type=float, help=f"default: {DEMO_LR:g}, or {RANDOM_INIT_LR:g} with "
                        "--random_init")
    parser.add_argument("--choose_lr", type=float, nargs="+", metavar="LR", help="train each learning rate and score "
                        f"it on the validation split every {EVAL_EVERY} steps instead; the record names the best")
    parser.add_argument("--random_init", action="store_true", help="the same architecture from random init, in full")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps of 2 x 8 snippets (default {STEPS})")
    parser.add_argument("--procs", type=int, default=2, help="DDP processes (one per GPU on a GPU machine)")
    parser.add_argument("--model_dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--data_dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--runs_dir", type=Path, default=REPO / "runs" / "demo-decoder")
    parser.add_argument("--results_dir", type=Path, default=REPO / "results")
    args = parser.parse_args(argv)
    if args.random_init and args.choose_lr:
        parser.error("--choose_lr chooses the LoRA run's rate; give the random-init arm's with --learning_rate")
    kind = "decoder_random_init" if args.random_init else "decoder_lr" if args.choose_lr else "decoder"
    start = ["--random_init"] if args.random_init else ["--use_peft", "--lora_r", str(LORA_R)]
    split = "validation" if args.choose_lr else "eval"
    rates = args.choose_lr or [args.learning_rate or (RANDOM_INIT_LR if args.random_init else DEMO_LR)]
    try:
        check_staged(args.model_dir)
        if not (args.data_dir / "split.json").is_file():
            raise RecipeError(f"{args.data_dir} has no split.json: run make fetch-pretrained")
        runs = [run_once(args, split, lr, seed, start, args.runs_dir / kind / f"lr{lr:g}_seed{seed}",
                         EVAL_EVERY if args.choose_lr else None) for lr in rates for seed in args.seeds]
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    split_record = json.loads((args.data_dir / "split.json").read_text())
    record = {"date": dt.date.today().isoformat(), "kind": kind,
              "command": "python scripts/demo_decoder.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "procs": args.procs, "steps": args.steps,
              "model": {"path": relative(args.model_dir), "sha256": json.loads(
                  (args.model_dir / "staging.json").read_text())["sha256"]["model.safetensors"]},
              "data": {**split_record["splits"], "seed": split_record["seed"]}, "hardware": hardware(),
              "versions": versions(not args.random_init), "flags": RUN_FLAGS, "start_flags": start, "runs": runs}
    record.update(summarise(runs, kind, args.results_dir, args.procs))
    hw = record["hardware"]
    stem = f"{record['date']}_{kind}_{slug(hw['device'])}_{slug(hw['host'])}"
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.results_dir / f"{stem}.md").write_text(render_markdown(record))
    print(f"{split} accuracy, mean over {len(runs)} run(s): {record['mean_accuracy']:.4f}"
          + (f"; chosen learning rate {record['chosen_learning_rate']:g}" if "chosen_learning_rate" in record else "")
          + f"; wrote {args.results_dir / stem}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
