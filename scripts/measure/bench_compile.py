"""`make bench BENCH=compile`: the recipe compiled (--torch_compile) beside the recipe eager, on the same work.

    make bench BENCH=compile   # 14.3 min on 2 CPU cores (2026-11-27), about 25 min with inductor's cache cold
    python scripts/measure/bench_compile.py [--runs_dir runs/bench] [--results_dir results]   # the same
    python scripts/measure/bench_compile.py --models roberta-base --dropout none --sides eager loop --rounds 8 \
        --tag loop
                               # one pair only, more rounds: results/<date>_compile-loop_<device>_<host>.{json,md}

Rows: the tiny model (dynamic padding, as users run it) and the roberta-base shape (random init, batch 8 x 128 fixed
by --pad_to_max_length), each with its config's dropout (0.1) and without dropout (a copy of its config with both
dropout probabilities 0), fp32, one process with every core (bench.threads_of). Eager and compiled runs of a pair
take turns in interleaved rounds (E C, C E, ...; round r with seed 42 + r, so both sides of a round train the same
samples), as the main bench runs its COMPARED runs, and each ratio is taken within a round: compiled / eager speed
as median with min-max over the rounds. With dropout a third side takes its turn, compiled with inductor's own
dropout generator (--torch_compile_rng inductor, the GPU default) beside the CPU default, torch's generator; without
dropout the plain loop (scripts/measure/bench_baselines.py loop, the same batches) does, for the recipe's MFU against
the loop's in the same rounds (recipe / loop speed: the loop's step time over the recipe's eager one).

Per run: the median step time over the steps after the warm-up whose graph count did not grow (a step that compiled
is compile time, reported apart as compile_s, dynamo and inductor's own count), tokens/s as those steps' mean tokens
over that median, the graphs compiled (training, then with the evaluation), and MFU: model FLOP/s (matmul FLOPs,
training_flops_per_position) of the token positions computed (padding included: the work the CPU did, which is what
compilation changes; 8 x 128 per step on the roberta-base shape) over the fp32 matmul rate this bench measures on
the run's threads right before and right after the run (the better of the two: a rate slowed by other work would
flatter the MFU). Each compiled run's per-step losses are compared with the eager run's of the same round (max
relative difference): equal without dropout, and with dropout where both draw from torch's generator.

Results: results/<date>_compile_<device>_<host>.{json,md}.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from recipes.outputs.records import library_versions, read_jsonl
from scripts.measure.bench import (ACCELERATE, PROFILES, PYTHON, REPO, Profile, Run, cpu_matmul_flops, execute,
                           free_port, hardware, progress, run_env, threads_of)
from scripts.measure.bench_report import round_order, slug, spread, unused_stem

SIDES = ("eager", "compiled")
# With dropout, a third side: compiled with inductor's own dropout generator, the default on GPUs (on CPU the recipe's
# default draws from torch's, as eager: recipes/model/compilation.py)
INDUCTOR_RNG = "compiled_inductor_rng"
SIDE_FLAGS = {"eager": [], "compiled": ["--torch_compile"],
              INDUCTOR_RNG: ["--torch_compile", "--torch_compile_rng", "inductor"]}
# Without dropout, the plain loop (scripts/measure/bench_baselines.py loop: the same batches, the recipe's losses) takes
# its turn too: its MFU against the recipe's eager one, in the same rounds
LOOP = "loop"
# each side compared with eager: (the ratio's name after the pair's, what its speed is, the side's name in the MFU)
VERSUS_EAGER = {"compiled": ("", "compiled / eager", "compiled"),
                INDUCTOR_RNG: (", inductor's generator", "compiled / eager", "compiled"),
                LOOP: (", recipe eager against the plain loop", "recipe / loop", "loop")}


@dataclass
class Work:
    name: str
    path: str
    random_init: bool
    steps: int  # optimizer steps of each run
    warmup_steps: int  # left out of the timing, besides any step that compiled
    batch: int
    flags: tuple  # shape policy: dynamic padding (none) or fixed length
    learning_rate: float
    seq_len: int = 128  # for the attention term of model_flops


WORK = (Work("tiny", "artifacts/tiny-roberta", False, 40, 5, 16, (), 1e-3),
        Work("roberta-base", "artifacts/roberta-base-shape", True, 10, 3, 8, ("--pad_to_max_length",), 2e-5))


def without_dropout(work: Work, runs_dir: Path) -> str:
    """A copy of the model folder whose config has no dropout (weights, when there are, copied along)."""
    folder = runs_dir / "models" / f"{work.name}-no-dropout"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(REPO / work.path, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return str(folder)


def command(work: Work, model: str, side: str, seed: int, run_dir: Path, threads: int) -> list:
    if side == LOOP:  # one process, no launcher: as `make bench` runs it
        return [PYTHON, "scripts/measure/bench_baselines.py", "loop", "--model_name_or_path", model,
                *(["--random_init"] if work.random_init else []), "--output_dir", str(run_dir), "--seed", str(seed),
                "--max_train_samples", str(work.steps * work.batch), "--batch_size", str(work.batch),
                "--max_eval_samples", str(2 * work.batch), "--learning_rate", str(work.learning_rate),
                "--precision", "fp32", *work.flags]
    return [ACCELERATE, "launch", "--config_file", "accelerate_configs/single.yaml", "--mixed_precision", "no",
            "--main_process_port", str(free_port()), "recipes/cls.py", "--model_name_or_path", model,
            *(["--random_init"] if work.random_init else []), "--output_dir", str(run_dir), "--seed", str(seed),
            "--max_train_samples", str(work.steps * work.batch), "--max_train_steps", str(work.steps),
            "--per_device_train_batch_size", str(work.batch), "--per_device_eval_batch_size", str(work.batch),
            "--max_eval_samples", str(2 * work.batch), "--max_length", str(work.seq_len),
            "--learning_rate", str(work.learning_rate), "--logging_steps", "1", "--report_to", "none",
            "--cpu_threads", str(threads), *work.flags, *SIDE_FLAGS[side]]


def timing(metrics: list, warmup_steps: int) -> dict:
    """Step time and tokens/s over the steps after the warm-up that compiled nothing; the compile totals."""
    ends = [0.0] + [r["elapsed"] for r in metrics]
    graphs = [0] + [r.get("graphs", 0) for r in metrics]
    kept = [(ends[i + 1] - ends[i], r["tokens"], r["padded_tokens"]) for i, r in enumerate(metrics)
            if i >= warmup_steps and graphs[i + 1] == graphs[i]]
    step_time = statistics.median(k[0] for k in kept)  # a stall of the shared machine moves a median little
    return {"step_time_s": step_time, "tokens_per_s": statistics.mean(k[1] for k in kept) / step_time,
            "positions_per_s": statistics.mean(k[2] for k in kept) / step_time,
            "timed_steps": len(kept), "train_graphs": graphs[-1], "compile_s": metrics[-1].get("compile_s", 0.0)}


def one_run(work: Work, model: str, dropout: str, side: str, round_: int, runs_dir: Path, timeout: int) -> dict:
    import torch

    threads = threads_of(1)
    run_dir = runs_dir / f"{work.name}_{dropout}_{side}_r{round_}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    row = {"model": work.name, "dropout": dropout, "side": side, "round": round_, "seed": 42 + round_,
           "threads": threads, "run_dir": str(run_dir), "status": "ok", "reason": ""}
    before = cpu_matmul_flops(torch.float32, threads)
    run = Run(model=work.name, name=side, kind="compile")  # what bench.execute fills: status, reason, wall time
    execute(run, command(work, model, side, 42 + round_, run_dir, threads), run_dir,
            Profile(models=[], run_timeout=timeout), run_env(threads, 1))
    matmul = max(before, cpu_matmul_flops(torch.float32, threads))
    row.update(status=run.status, reason=run.reason, wall_s=run.wall_s, matmul_flops=matmul)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if run.status == "ok" and len(metrics) == work.steps:
        row.update(timing(metrics, work.warmup_steps))
        evals = read_jsonl(run_dir / "eval.jsonl")
        row["graphs"] = evals[-1].get("graphs", 0) if evals else row["train_graphs"]
        row["compile_s"] = evals[-1].get("compile_s", row["compile_s"]) if evals else row["compile_s"]
        row["losses"] = [r["loss"] for r in metrics]
        row["model_flops_per_s"] = training_flops_per_position(str(REPO / work.path), work.seq_len) * \
            row["positions_per_s"]
        row["mfu"] = row["model_flops_per_s"] / matmul
    elif run.status == "ok":
        row.update(status="failed", reason=f"{len(metrics)} of {work.steps} steps recorded")
    return row


def training_flops_per_position(path: str, seq_len: int) -> float:
    """Matmul FLOPs of one training step per token position: 6 per weight of every Linear (forward 2, backward 4)
    plus attention's scores and weighted sum, 12 x layers x hidden x length. Unlike bench.model_flops (6 per
    parameter) it leaves out the embedding tables, which a classifier looks up but never multiplies: 30% of
    roberta-base's parameters, which would put the MFU of padded positions above 1."""
    import torch

    from recipes.checks.launch_checks import model_skeleton

    model = model_skeleton(path, 2)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    config = model.config
    return 6 * linear + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def compile_ratios(rows: list) -> dict:
    """Per model and dropout: compiled / eager speed (eager step time over compiled) within each round, median and
    min-max; the largest per-step relative loss difference of the rounds without dropout; graphs and compile time."""
    out = {}
    for key in dict.fromkeys((r["model"], r["dropout"]) for r in rows):
        ok = [r for r in rows if (r["model"], r["dropout"]) == key and r["status"] == "ok"]
        for side, (suffix, label, _) in VERSUS_EAGER.items():
            pairs = [(e, c) for e in ok for c in ok if e["side"] == "eager" and c["side"] == side
                     and e["round"] == c["round"]]
            if not pairs:
                continue
            # compiled / eager speed; for the loop the recipe's (eager) / the loop's, so > 1: the recipe is faster
            speed = [(c["step_time_s"] / e["step_time_s"]) if side == LOOP else (e["step_time_s"] / c["step_time_s"])
                     for e, c in pairs]
            entry = {"speedup": spread(speed), "label": label,
                     "graphs": max(c["graphs"] for _, c in pairs),
                     "train_graphs": max(c["train_graphs"] for _, c in pairs),
                     "compile_s": spread([c["compile_s"] for _, c in pairs]),
                     "mfu": {s: spread([r["mfu"] for r in ok if r["side"] == s]) for s in ("eager", side)},
                     # with dropout: equal where both draw from torch's generator, apart where inductor draws
                     "max_loss_rel_diff": max(abs(a - b) / abs(b) for e, c in pairs
                                              for a, b in zip(c["losses"], e["losses"]))}
            out[f"{key[0]} dropout {key[1]}{suffix}"] = entry
    return out


def markdown(results: dict) -> str:
    lines = [f"# torch.compile bench, {results['date']}, {results['hardware']['cpu']}", "",
             f"`{results['command']}`, {results['duration_s'] / 60:.1f} min; versions {results['versions']}", "",
             "| model | dropout | run | round | s/step | tokens/s | MFU | matmul GFLOP/s | graphs (train) | "
             "compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['dropout']} | {r['side']} | {r['round']} | {r['status']}: "
                         f"{r['reason']} | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['dropout']} | {r['side']} | {r['round']} | {r['step_time_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['mfu']:.3f} | {r['matmul_flops'] / 1e9:.1f} | "
                     f"{r.get('graphs', 0)} ({r['train_graphs']}) | {r['compile_s']:.1f} |")
    lines += ["", *ratio_lines(results), ""]
    return "\n".join(lines)


def ratio_lines(results: dict) -> list[str]:
    lines = []
    for name, e in results["ratios"].items():
        s = e["speedup"]
        other = next(side for side in e["mfu"] if side != "eager")
        line = (f"{name}: {e.get('label', 'compiled / eager')} speed {s['median']:.3f} (min {s['min']:.3f}, max "
                f"{s['max']:.3f}, {s['rounds']} rounds); MFU eager {e['mfu']['eager']['median']:.3f}, "
                f"{VERSUS_EAGER[other][2]} {e['mfu'][other]['median']:.3f}")
        if other != LOOP:
            line += f"; {e['graphs']} graphs ({e['train_graphs']} training), compile {e['compile_s']['median']:.1f} s"
        if "max_loss_rel_diff" in e:  # results before 2026-11-27 have it without dropout only
            line += f"; per-step losses within {e['max_loss_rel_diff']:.1e} (relative) of " + (
                "eager" if other != LOOP else "the recipe's")
        lines.append(line)
    return lines


# The sides of each dropout setting: without dropout the generators do not matter, and the loop has none
SIDES_OF = {"config": [*SIDES, INDUCTOR_RNG], "none": [*SIDES, LOOP]}


def run(profile: Profile, runs_dir: Path, results_dir: Path, command_line: str, log=progress, only=None,
        tag: str = "") -> dict:
    """Every pair of the profile in interleaved rounds; writes and returns the results. `only` keeps some of them:
    {"models": names, "dropout": settings, "sides": names} (each None for all); `tag` names the results file
    <date>_compile-<tag>_..., apart from the whole bench's."""
    only = only or {}
    started = dt.datetime.now()
    works = [w for w in WORK if w.name in {spec.name for spec in profile.models}
             and w.name in (only.get("models") or [w.name])]
    sides = {dropout: [side for side in names if side in (only.get("sides") or names)]
             for dropout, names in SIDES_OF.items() if dropout in (only.get("dropout") or SIDES_OF)}
    schedule = [(w, dropout, side, r) for w in works for dropout in sides
                for r in range(profile.repeats) for side in round_order(sides[dropout], r)]
    log(f"bench compile: {len(schedule)} runs, {profile.repeats} interleaved rounds per pair")
    rows, models = [], {}
    for i, (work, dropout, side, round_) in enumerate(schedule, 1):
        if (work.name, dropout) not in models:
            models[work.name, dropout] = work.path if dropout == "config" else without_dropout(work, runs_dir)
        row = one_run(work, models[work.name, dropout], dropout, side, round_, runs_dir, profile.run_timeout)
        rows.append(row)
        figures = (f"{row['step_time_s']:.3f} s/step, MFU {row['mfu']:.3f}, graphs {row['graphs']}, compile "
                   f"{row['compile_s']:.1f} s" if row["status"] == "ok" else f"{row['status']}: {row['reason']}")
        log(f"{i:>2}/{len(schedule)} {work.name} dropout {dropout} {side} round {round_}: {figures}")
    results = {"date": started.strftime("%Y-%m-%d"), "started": started.isoformat(timespec="seconds"),
               "duration_s": (dt.datetime.now() - started).total_seconds(), "command": command_line,
               "hardware": hardware(), "versions": library_versions(),
               "work": {w.name: {"model": w.path, "random_init": w.random_init, "steps": w.steps,
                                 "warmup_steps": w.warmup_steps, "batch": w.batch, "flags": list(w.flags)}
                        for w in works},
               "runs": rows, "ratios": compile_ratios(rows)}
    results_dir.mkdir(parents=True, exist_ok=True)
    kind = f"compile-{tag}" if tag else "compile"
    stem = unused_stem(results_dir, f"{results['date']}_{kind}_{slug(results['hardware']['device'])}_"
                                    f"{slug(results['hardware']['host'])}")  # a second run the same day: -2, ...
    (results_dir / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (results_dir / f"{stem}.md").write_text(markdown(results))
    log("\n".join(["", *ratio_lines(results), "", f"wrote {results_dir / stem}.{{json,md}}"]))
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs_dir", default=str(REPO / "runs" / "bench"))
    parser.add_argument("--results_dir", default=str(REPO / "results"))
    parser.add_argument("--models", nargs="+", choices=[w.name for w in WORK], help="default: both")
    parser.add_argument("--dropout", nargs="+", choices=list(SIDES_OF), help="default: both settings")
    parser.add_argument("--sides", nargs="+", choices=list(SIDE_FLAGS) + [LOOP], help="default: every side")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: the compile profile's)")
    parser.add_argument("--tag", default="", help="results/<date>_compile-<tag>_...: a partial run's own file")
    args = parser.parse_args(argv)
    if (args.models or args.dropout or args.sides or args.rounds) and not args.tag:
        parser.error("a partial or longer run needs --tag: its results file is not the whole bench's")
    profile = PROFILES["compile"]
    if args.rounds:
        profile = dataclasses.replace(profile, repeats=args.rounds)
    run(profile, Path(args.runs_dir).resolve(), Path(args.results_dir),
        "python scripts/measure/bench_compile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        only={"models": args.models, "dropout": args.dropout, "sides": args.sides}, tag=args.tag)


if __name__ == "__main__":
    main()
