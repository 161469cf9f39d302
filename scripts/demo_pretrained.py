"""make demo-pretrained: fine-tune a real pretrained encoder on real English text, offline, and keep a dated record.

    make demo-pretrained                   # one seed, DDP on 2 processes: 850 CPU s, about 8 min on 2 idle cores
    make demo-pretrained SEEDS="42 43 44"  # the three seeds the docs quote
    python scripts/demo_pretrained.py --choose_lr 5e-5 1e-4 2e-4          # the learning rate, on the validation split
    python scripts/demo_pretrained.py --random_init --learning_rate 1e-3  # the same architecture from random init
    python scripts/demo_pretrained.py --use_peft --choose_lr 5e-4 1e-3 2e-3  # LoRA r 8: its learning rate
    python scripts/demo_pretrained.py --use_peft --seeds 42 43 44            # LoRA against full fine-tuning, paired

The model is all-MiniLM-L6-v2 (artifacts/minilm) and the data Rotten Tomatoes critic snippets, fresh or rotten,
split by movie (artifacts/rotten_tomatoes; both from `make fetch-pretrained`, scripts/fetch_pretrained.py). Each run
is the recipe, `accelerate launch --config_file accelerate_configs/ddp.yaml recipes/cls.py`, trained on train.csv for
one epoch with RUN_FLAGS and scored on eval.csv, or with --choose_lr on validation.csv (movies cut from the training
ones), so that the learning rate is never chosen on the eval set.

Each invocation writes results/<date>_<kind>_<device>_<host>.{json,md}: kind `pretrained` or `random_init` (eval
split), `pretrained_lr` or `random_init_lr` (--choose_lr, validation split). A record holds every run's seed,
learning rate, accuracy, macro-F1, steps, wall and CPU seconds, the machine's load average before and after and the
share of the machine's CPU that other work took meanwhile (scripts/measure/bench_load.py); the `pretrained` record also
quotes the random-init figure from the latest `random_init` record rather than training it again.

With --use_peft the runs train LoRA adapters (the recipe's --use_peft, rank --lora_r) and the head on the frozen
encoder: kinds `lora` and `lora_lr`. A `lora` record pairs its runs by seed with the latest `pretrained` record (full
fine-tuning, same data, flags and steps) and gives the mean paired difference with its 95% Student's t interval.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

from recipes import RecipeError
from recipes.outputs.records import library_versions, read_jsonl
from scripts.measure import bench_load
from scripts.measure.bench import ACCELERATE, failure_reason, free_port, hardware
from scripts.measure.bench_report import slug
from scripts.fetch_pretrained import DEFAULT_DATA_DIR, DEFAULT_MODEL_DIR, WEIGHTS, check_weights, sha256_of
from scripts.sweep import summary as t_summary

REPO = Path(__file__).resolve().parent.parent
# Chosen on the validation split (results/2026-11-26_pretrained_lr_cpu_vm.md): 1e-4 scored 0.8324, 5e-5 0.8255, 2e-4
# 0.8278.
DEMO_LR = 1e-4
RANDOM_INIT_LR = 1e-3  # the tiny model's demo rate: a random init wants a larger rate than a pretrained encoder
# LoRA r 8 (--use_peft), chosen on the validation split likewise (results/2026-11-26_lora_lr_cpu_vm.md): 1e-3 scored
# 0.8317, 5e-4 0.8178, 2e-3 0.8194.
LORA_LR = 1e-3
LORA_GOAL_POINTS = 1.5  # goal: the 95% interval of LoRA - full fine-tuning reaches -1.5 points or above
# One epoch of 10,308 snippets, 2 x 16 per step (323 steps). Snippets are 27 tokens on average and at most 78, so 64
# cuts 7 of them; length-grouped batches pad little (about 1.6x faster than dynamic padding alone, measured here).
RUN_FLAGS = ["--text_column", "text", "--label_column", "label", "--max_length", "64",
             "--per_device_train_batch_size", "16", "--group_by_length", "--num_train_epochs", "1"]
KINDS = ("pretrained", "random_init", "lora", "pretrained_lr", "random_init_lr", "lora_lr")


def launch_metered(command: list[str], run_dir: Path, label: str) -> dict:
    """One launch, logged to run_dir/launch.log: its wall and CPU seconds, the machine's load around it and the share
    of the CPU other work took, its folder and command; a failed launch is a RecipeError with its reason."""
    log_path = run_dir / "launch.log"
    print(f"{label}: training (log: {log_path})", flush=True)
    load_before, meter, start = os.getloadavg(), bench_load.LaunchMeter(), time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        meter.start(proc.pid)
        returncode = proc.wait()
    wall, cpu = time.perf_counter() - start, meter.stop()
    if returncode != 0:
        raise RecipeError(f"the run in {run_dir} failed (exit {returncode}): "
                          f"{failure_reason(log_path.read_text(errors='replace'))}")
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "others_share": round(bench_load.others_share(meter.samples) or 0.0, 3),
            "loadavg_before": [round(v, 2) for v in load_before],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()], "run_dir": relative(run_dir / "run"),
            "command": [relative(arg) for arg in command]}


def run_once(model_dir: Path, data_dir: Path, split: str, lr: float, seed: int, start: list[str], procs: int,
             run_dir: Path) -> dict:
    """One launch of the recipe; its scores, steps, time and the machine's load around it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = [ACCELERATE, "launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", str(procs),
               "--main_process_port", str(free_port()), "recipes/cls.py", "--model_name_or_path", str(model_dir),
               *start, "--train_file", str(data_dir / "train.csv"),
               "--validation_file", str(data_dir / f"{split}.csv"), *RUN_FLAGS, "--learning_rate", str(lr),
               "--seed", str(seed), "--output_dir", str(run_dir / "run")]
    measured = launch_metered(command, run_dir, f"seed {seed}, learning rate {lr:g}")
    scores = read_jsonl(run_dir / "run" / "eval.jsonl")[-1]
    result = {"seed": seed, "learning_rate": lr, "accuracy": scores["accuracy"], "f1_macro": scores["f1_macro"],
              "n_examples": scores["n_examples"], "steps": scores["step"], **measured}
    print(f"seed {seed}, learning rate {lr:g}: {split} accuracy {result['accuracy']:.4f} on {result['n_examples']} "
          f"snippets, {result['wall_s'] / 60:.1f} min", flush=True)
    return result


def versions(use_peft: bool) -> dict:
    """The pinned stack's versions, and peft's where the runs trained LoRA adapters."""
    from importlib.metadata import version

    return {**library_versions(), **({"peft": version("peft")} if use_peft else {})}


def relative(arg) -> str:
    """A path inside the checkout as the checkout's relative path, so that a record reads the same on any machine."""
    text = str(arg)
    return os.path.relpath(text, REPO) if text.startswith(str(REPO) + os.sep) else text


def latest_record(results_dir: Path, kind: str, kinds=KINDS, files=None) -> tuple[Path, dict] | None:
    """The newest record of `kind` (one of `kinds`) in results_dir, or among `files`, by date in its name: a file named
    <date>_<kind>_<device>_<host>.json whose record says it is of that kind (decoder_memory_* is no `decoder` record)."""
    found = [(p, json.loads(p.read_text())) for p in sorted(results_dir.glob("*.json") if files is None else files)
             if record_kind(p.stem, kinds) == kind]
    found = [(p, record) for p, record in found if record.get("kind") == kind]
    return found[-1] if found else None


def record_kind(stem: str, kinds=KINDS) -> str | None:
    """The kind of a results file's stem <date>_<kind>_<device>_<host>; None for other results files."""
    rest = stem.split("_", 1)[1] if "_" in stem else ""
    return next((k for k in sorted(kinds, key=len, reverse=True) if rest.startswith(k + "_")), None)


def summarise(runs: list, kind: str, results_dir: Path) -> dict:
    accuracies = [r["accuracy"] for r in runs]
    summary = {"mean_accuracy": round(mean(accuracies), 4), "min_accuracy": min(accuracies),
               "max_accuracy": max(accuracies)}
    if kind.endswith("_lr"):  # the best learning rate by mean validation accuracy over its seeds
        by_lr = {}
        for r in runs:
            by_lr.setdefault(r["learning_rate"], []).append(r["accuracy"])
        summary["validation_accuracy_by_lr"] = {f"{lr:g}": round(mean(a), 4) for lr, a in by_lr.items()}
        summary["chosen_learning_rate"] = max(by_lr, key=lambda lr: mean(by_lr[lr]))
    if kind == "lora":
        summary["against_full"] = paired_with_full(runs, results_dir)
    if kind == "pretrained":
        found = latest_record(results_dir, "random_init")
        summary["random_init"] = None if found is None else {
            "record": found[0].stem, "mean_accuracy": found[1]["mean_accuracy"],
            "learning_rates": sorted({r["learning_rate"] for r in found[1]["runs"]}), "seeds": len(found[1]["runs"])}
    return summary


def paired_with_full(runs: list, results_dir: Path) -> dict | None:
    """LoRA minus full fine-tuning, seed by seed, against the latest `pretrained` record: mean and 95% t interval."""
    found = latest_record(results_dir, "pretrained")
    if found is None:
        return None
    full = {r["seed"]: r["accuracy"] for r in found[1]["runs"]}
    pairs = [(r["seed"], r["accuracy"] - full[r["seed"]]) for r in runs if r["seed"] in full]
    if not pairs:
        return None
    stats = t_summary([d for _, d in pairs])
    reach = None if stats["ci95"] is None else stats["ci95"][1] >= -LORA_GOAL_POINTS / 100
    return {"record": found[0].stem, "seeds": [s for s, _ in pairs],
            "full_mean_accuracy": round(mean(full[s] for s, _ in pairs), 4),
            "differences": [round(d, 4) for _, d in pairs], "mean_difference": round(stats["mean"], 4),
            "ci95": None if stats["ci95"] is None else [round(v, 4) for v in stats["ci95"]],
            "goal_points": LORA_GOAL_POINTS, "goal_met": reach}


def render_markdown(record: dict) -> str:
    split = "validation" if record["kind"].endswith("_lr") else "eval"
    data, hw, v = record["data"], record["hardware"], record["versions"]
    start = "random init (--random_init)" if record["kind"].startswith("random_init") else \
        f"the pretrained weights ({WEIGHTS} SHA-256 {record['model']['sha256'][:12]}...)"
    if record["kind"].startswith("lora"):
        start += f", frozen, with LoRA adapters (`{' '.join(record['start_flags'])}`) and the head trained"
    lines = [f"# {record['kind']} {record['date']}: all-MiniLM-L6-v2 on Rotten Tomatoes, scored on {split}", "",
             f"`{record['command']}`", "",
             f"Model: {record['model']['path']}, from {start}. Data: {data['train']['rows']:,} training snippets "
             f"({data['train']['movies']} movies), scored on the {split} split's {data[split]['rows']:,} "
             f"({data[split]['movies']} movies, {data[split]['fresh_share']:.4f} fresh), split by movie with seed "
             f"{data['seed']}. Each run: DDP on {record['procs']} processes, `{' '.join(RUN_FLAGS)}`.", "",
             "| seed | learning rate | accuracy | macro-F1 | examples | steps | minutes | load average before / after "
             "| others' CPU share |", "|--:|--:|--:|--:|--:|--:|--:|---|--:|"]
    for r in record["runs"]:
        lines.append(f"| {r['seed']} | {r['learning_rate']:g} | {r['accuracy']:.4f} | {r['f1_macro']:.4f} "
                     f"| {r['n_examples']} | {r['steps']} | {r['wall_s'] / 60:.1f} | {r['loadavg_before'][0]:.2f} / "
                     f"{r['loadavg_after'][0]:.2f} | {r['others_share']:.3f} |")
    lines += ["", f"Mean accuracy over {len(record['runs'])} run(s): **{record['mean_accuracy']:.4f}** (min "
                  f"{record['min_accuracy']:.4f}, max {record['max_accuracy']:.4f})."]
    if "chosen_learning_rate" in record:
        scores = ", ".join(f"{lr}: {acc:.4f}" for lr, acc in record["validation_accuracy_by_lr"].items())
        lines.append(f"Validation accuracy by learning rate: {scores}; chosen: **{record['chosen_learning_rate']:g}**.")
    if record.get("random_init"):
        ri = record["random_init"]
        lines.append(f"The same architecture from random init ([{ri['record']}]({ri['record']}.md), not trained "
                     f"again here): {ri['mean_accuracy']:.4f} at learning rate "
                     f"{', '.join(f'{lr:g}' for lr in ri['learning_rates'])}.")
    if record.get("against_full"):
        af = record["against_full"]
        ci = "no interval from one seed" if af["ci95"] is None else \
            f"95% t interval [{af['ci95'][0] * 100:+.2f}, {af['ci95'][1] * 100:+.2f}] points"
        lines.append(f"Against full fine-tuning at the same steps ([{af['record']}]({af['record']}.md), mean "
                     f"{af['full_mean_accuracy']:.4f} on seeds {', '.join(map(str, af['seeds']))}): LoRA - full, "
                     f"paired by seed, {', '.join(f'{d * 100:+.2f}' for d in af['differences'])} points; mean "
                     f"**{af['mean_difference'] * 100:+.2f}** points, {ci}. Goal (the interval reaches within "
                     f"{af['goal_points']} points of full fine-tuning): "
                     f"{'met' if af['goal_met'] else 'not met' if af['goal_met'] is False else 'undecided'}.")
    lines += ["", f"Hardware: {hw['cpu']}, {hw['cpu_cores']} cores, {hw.get('memory_gib', '?')} GiB. Versions: "
                  + ", ".join(f"{k} {val}" for k, val in v.items()) + ". Load: the 1-minute load average before and "
                  "after each run, and the share of the machine's CPU that other work took during it.", ""]
    return "\n".join(lines)


def write_record(record: dict, results_dir: Path) -> dict:
    hw = record["hardware"]
    stem = f"{record['date']}_{record['kind']}_{slug(hw['device'])}_{slug(hw['host'])}"
    results_dir.mkdir(parents=True, exist_ok=True)
    paths = {ext: results_dir / f"{stem}.{ext}" for ext in ("json", "md")}
    paths["json"].write_text(json.dumps(record, indent=2) + "\n")
    paths["md"].write_text(render_markdown(record))
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="one run per seed (default: 42)")
    parser.add_argument("--learning_rate", type=float, help=f"default: {DEMO_LR:g}, or {RANDOM_INIT_LR:g} with "
                        "--random_init")
    parser.add_argument("--choose_lr", type=float, nargs="+", metavar="LR", help="train each learning rate and score "
                        "it on the validation split instead; the record names the best")
    parser.add_argument("--random_init", action="store_true", help="the same architecture from random init")
    parser.add_argument("--use_peft", action="store_true", help="LoRA adapters and the head on the frozen encoder")
    parser.add_argument("--lora_r", type=int, default=8, help="the adapters' rank with --use_peft (default: 8)")
    parser.add_argument("--procs", type=int, default=2, help="DDP processes (one per GPU on a GPU machine)")
    parser.add_argument("--model_dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--data_dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--runs_dir", type=Path, default=REPO / "runs" / "demo-pretrained")
    parser.add_argument("--results_dir", type=Path, default=REPO / "results")
    args = parser.parse_args(argv)
    if args.random_init and args.use_peft:
        parser.error("--random_init and --use_peft: LoRA on a random-init encoder proves nothing; choose one")
    base = "random_init" if args.random_init else "lora" if args.use_peft else "pretrained"
    kind = base + ("_lr" if args.choose_lr else "")
    start = ["--random_init"] if args.random_init else ["--use_peft", "--lora_r", str(args.lora_r)] \
        if args.use_peft else []
    split = "validation" if args.choose_lr else "eval"
    rates = args.choose_lr or [args.learning_rate or {"random_init": RANDOM_INIT_LR, "lora": LORA_LR}.get(base, DEMO_LR)]
    try:
        check_weights(args.model_dir)
        if not (args.data_dir / "split.json").is_file():
            raise RecipeError(f"{args.data_dir} has no split.json: run make fetch-pretrained")
        runs = [run_once(args.model_dir, args.data_dir, split, lr, seed, start, args.procs,
                         args.runs_dir / kind / f"lr{lr:g}_seed{seed}") for lr in rates for seed in args.seeds]
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    split_record = json.loads((args.data_dir / "split.json").read_text())
    record = {"date": dt.date.today().isoformat(), "kind": kind,
              "command": "python scripts/demo_pretrained.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "procs": args.procs, "model": {"path": relative(args.model_dir),
                                             "sha256": sha256_of(args.model_dir / WEIGHTS)},
              "data": {**split_record["splits"], "seed": split_record["seed"]},
              "hardware": hardware(), "versions": versions(args.use_peft), "flags": RUN_FLAGS, "start_flags": start,
              "runs": runs}
    record.update(summarise(runs, kind, args.results_dir))
    paths = write_record(record, args.results_dir)
    print(f"{split} accuracy, mean over {len(runs)} run(s): {record['mean_accuracy']:.4f}"
          + (f"; chosen learning rate {record['chosen_learning_rate']:g}" if "chosen_learning_rate" in record else "")
          + (f"; random init {record['random_init']['mean_accuracy']:.4f} ({record['random_init']['record']})"
             if record.get("random_init") else "")
          + (f"; LoRA - full {record['against_full']['mean_difference'] * 100:+.2f} points"
             if record.get("against_full") else ""))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
