"""make bench, the reporting half: throughput from a run's records, ratios, the results files, and the block of
docs/benchmark.md between the bench markers (BENCH_PAGE).

scripts/measure/bench.py runs the launches and hands this module a results dict; `python scripts/measure/bench.py
--rerender results/<file>.json` recomputes a results file from its runs' records with this module alone.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import os
import random
import re
import statistics
from pathlib import Path

from recipes.outputs.records import read_jsonl
from scripts.measure import bench_load

REPO = Path(__file__).resolve().parents[2]
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"
BENCH_PAGE = REPO / "docs" / "benchmark.md"  # the page `make bench` rewrites between the markers (not README.md)
MIB = 1024**2
# The goals the quick profile is held to (issue 13): medians over rounds, times of the same samples. The overheads
# are judged in one process (the `alternate` run), where the three take turns every few steps on the same batches.
GOALS = {"recipe_vs_hand_loop_same_process": ("<=", 1.03), "trainer_vs_recipe_same_process": (">=", 1.0),
         "grouped_speedup_vs_pad128": (">=", 2.0), "grouped_speedup_vs_dynamic": (">=", 1.5),
         # padding-free batches: at least 0.85 of the speed-up that computing only the real tokens bounds (P/R), and
         # grouped batches, already nearly without padding, not slowed by more than 3%
         "padding_free_fraction_of_bound": (">=", 0.85), "padding_free_grouped_vs_grouped": (">=", 0.97)}
# The headline ratios (issue 37): each is reported with the 95% bootstrap interval of its median, whose half-width
# should be at most HALF_WIDTH_GOAL, so that a change of a few percent can be told from the noise.
HEADLINES = ("recipe_vs_hand_loop_same_process", "trainer_vs_recipe_same_process", "recipe_vs_hand_loop_time",
             "trainer_vs_recipe_time")
HALF_WIDTH_GOAL = 0.03
BOOTSTRAP_RESAMPLES = 2000
ACCURACY_POINTS = 0.5  # grouped batches may move accuracy by at most this many points (mean over the rounds)
COMM_TOLERANCE = 0.10  # measured / predicted communication further than this from 1 is explained below the table
# Why a strategy's measured bytes per step depart from the textbook (2 psi (n-1)/n for DDP and ZeRO-1/2, 3 psi (n-1)/n
# for ZeRO-3 and FSDP2), read in the pinned sources and seen in the probe's per-collective breakdown.
COMM_NOTES = {
    "zero1": "DeepSpeed 0.19.8 reduces each ZeRO-1/2 gradient bucket with one all-reduce of the whole bucket, every "
             "rank keeping its partition (zero_optimization.use_multi_rank_bucket_allreduce, default true), not a "
             "reduce-scatter: 2 psi (n-1)/n for the gradients plus psi (n-1)/n for the all-gather of the updated "
             "parameters, 1.5x the textbook; \"use_multi_rank_bucket_allreduce\": false reduces each slice to its "
             "owner instead (psi (n-1)/n; 1.000 on the tiny model). Its grad-norm all-reduce adds a few bytes.",
    "zero3": "ds_configs/zero3*.json keep every gathered parameter until backward (stage3_max_reuse_distance and "
             "stage3_max_live_parameters 1e9), so backward gathers nothing again: psi (n-1)/n of all-gathers plus "
             "psi (n-1)/n of gradient reduce-scatter, 2/3 of the textbook; with both at 0 backward gathers again "
             "(textbook, 0.999 on the tiny model): less memory for those bytes.",
    "fsdp": "FSDP2 keeps the root unit (parameters outside the wrapped layers and the input embedding) gathered from "
            "forward to the end of backward, so it is gathered once, not twice.",
}
COMM_NOTES["zero2"] = COMM_NOTES["zero2_offload"] = COMM_NOTES["zero1"]
COMM_NOTES["zero3_offload"] = COMM_NOTES["zero3"]


def throughput(metrics: list, warmup_steps: int) -> dict:
    """Over the steps after the warm-up: samples/s and tokens/s (totals over their time), the median time of one
    step, and its 10th percentile, which the ratios use. On a shared machine other work slows whole stretches of a
    run; the fastest decile is what a run costs when nothing else competes, and the one-process runs draw the same
    batches (same sampler and seed), so their fastest deciles hold the same work."""
    if len(metrics) <= warmup_steps:
        raise ValueError(f"{len(metrics)} steps recorded, need more than the {warmup_steps} warm-up steps")
    ends = [0.0] + [r["elapsed"] for r in metrics]
    durations = [b - a for a, b in zip(ends[warmup_steps:], ends[warmup_steps + 1:])]
    timed = metrics[warmup_steps:]
    seconds = ends[-1] - ends[warmup_steps]
    return {"samples_per_s": sum(r["samples"] for r in timed) / seconds,
            "tokens_per_s": sum(r["tokens"] for r in timed) / seconds, "step_time_s": statistics.median(durations),
            "fast_step_time_s": statistics.quantiles(durations, n=10, method="inclusive")[0]
            if len(durations) > 1 else durations[0]}


def epoch_figures(metrics: list) -> dict:
    """The time of all the training steps (every COMPARED run trains the same samples: the ratios' basis) and the
    padding efficiency, real tokens / padded tokens, where the run records its padded tokens."""
    padded = sum(r.get("padded_tokens", 0) for r in metrics)
    return {"epoch_s": metrics[-1]["elapsed"],
            "padding_efficiency": sum(r["tokens"] for r in metrics) / padded if padded else None}


def round_order(items: list, r: int) -> list:
    """The launch order of round r of interleaved runs: A B C, then C B A, ...; a linear drift of the machine's speed
    then hits every side alike over each pair of rounds."""
    return items[::-1] if r % 2 else items


def median_interval(values: list, resamples: int = BOOTSTRAP_RESAMPLES) -> list | None:
    """The 95% percentile-bootstrap interval of the median of `values` (rounds or blocks drawn with replacement,
    `resamples` times, from a fixed seed: the same records always give the same interval); None below 2 values."""
    if len(values) < 2:
        return None
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return [medians[round(0.025 * (resamples - 1))], medians[round(0.975 * (resamples - 1))]]


def spread(values: list, set_aside=(), kept=None, interval: bool = False) -> dict:
    """Median and min-max of `values` (with `interval`, also the median's 95% bootstrap interval, `ci95`);
    `set_aside`, where given, names the rounds (or blocks) left out of them, `kept` says which values count (all by
    default). Where every one was set aside, the figures are of all of them, marked `all_disturbed`: a number with a
    warning says more than none."""
    kept = [v for v, k in zip(values, kept or [True] * len(values)) if k] or None
    out = {"median": statistics.median(kept or values), "min": min(kept or values), "max": max(kept or values),
           "rounds": len(kept or values), **({"ci95": median_interval(kept or values)} if interval else {})}
    return {**out, "set_aside": list(set_aside), **({} if kept else {"all_disturbed": True})} if set_aside else out


# ratio name: (numerator run, denominator run), on epoch seconds: a time ratio (>1: the numerator is slower), or
# for the speedups the inverse
TIME_RATIOS = {"recipe_vs_hand_loop_time": ("single", "loop"), "trainer_vs_recipe_time": ("trainer", "single"),
               "pad128_vs_dynamic_time": ("pad128", "single"), "grouped_speedup_vs_pad128": ("pad128", "grouped"),
               "grouped_speedup_vs_dynamic": ("single", "grouped"),
               "padding_free_speedup_vs_dynamic": ("single", "padding_free"),
               "padding_free_grouped_vs_grouped": ("grouped", "padding_free_grouped"),
               "fused_adamw_speedup": ("unfused", "single"), "sdpa_speedup_vs_eager": ("eager_attn", "single"),
               "lora_speedup_vs_full": ("single", "lora")}
ACCURACY_RUNS = ("single", "pad128", "grouped", "padding_free", "padding_free_grouped")
# variant - reference accuracy in points, per round: (key, variant, reference)
ACCURACY_PAIRS = (("grouped_minus_dynamic_accuracy_points", "grouped", "single"),
                  ("padding_free_minus_dynamic_accuracy_points", "padding_free", "single"))
PADDING_FREE_RUNS = ("padding_free", "padding_free_grouped")  # their records count the positions computed


def round_ratio(by_round: dict, a: str, b: str, disturbed: set, scale=None):
    """a's epoch seconds / b's within each round that has both (times scale(round), where given), as spread over the
    rounds, less those where either side was disturbed; None where no round has both."""
    pairs = [(n, rnd[a]["epoch_s"] / rnd[b]["epoch_s"] * (scale(rnd) if scale else 1)) for n, rnd in by_round.items()
             if a in rnd and b in rnd and rnd[a].get("epoch_s") and rnd[b].get("epoch_s")]
    aside = [n for n, _ in pairs if {id(by_round[n][a]), id(by_round[n][b])} & disturbed]
    return spread([v for _, v in pairs], aside, [n not in aside for n, _ in pairs], interval=True) if pairs else None


def padding_free_figures(by_round: dict, disturbed: set) -> dict:
    """The bound of padding_free's speed-up over dynamic padding, P/R: the positions the dynamic run (`single`)
    computed over the real tokens, per round from its records (round 0's equals padding_costs' "dynamic"), the
    fraction of it that the speed-up reached, round by round, and the real / computed positions of the padding-free
    runs (their records' tokens / padded_tokens: 1 where nothing is padded)."""
    out = {}
    measured = {n: rnd for n, rnd in by_round.items()
                if "padding_free" in rnd and (rnd.get("single") or {}).get("padding_efficiency")}
    if measured:
        out["padding_free_bound"] = spread([1 / rnd["single"]["padding_efficiency"] for rnd in measured.values()])
        fraction = round_ratio(measured, "single", "padding_free", disturbed,
                               lambda rnd: rnd["single"]["padding_efficiency"])
        if fraction:
            out["padding_free_fraction_of_bound"] = fraction
    computed = {name: [rnd[name]["padding_efficiency"] for _, rnd in sorted(by_round.items())
                       if (rnd.get(name) or {}).get("padding_efficiency")] for name in PADDING_FREE_RUNS}
    if any(computed.values()):
        out["padding_free_real_vs_computed"] = {name: spread(values) for name, values in computed.items() if values}
    return out


def ratios(runs: list) -> dict:
    """Per model: each ratio of TIME_RATIOS within each interleaved round (same seed, same samples), as median and
    min-max over the rounds, leaving out the rounds where either side was disturbed (bench_load.screen); the bound of
    the padding-free speed-up and the fraction of it reached (padding_free_figures); accuracy of the padding variants
    per round and their difference from dynamic padding's; the memory and communication ratios of round 0. `runs`
    are the results' run dicts."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in runs):
        screened = bench_load.screen([r for r in runs if r["model"] == model and r["status"] == "ok"])
        ok, disturbed = screened["kept"], {id(r) for r, _ in screened["disturbed"]}
        by_round = {}
        for r in ok:
            by_round.setdefault(r.get("round", 0), {})[r["name"]] = r
        entry = {}
        for key, (a, b) in TIME_RATIOS.items():
            ratio = round_ratio(by_round, a, b, disturbed)
            if ratio:
                entry[key] = ratio
        entry.update(padding_free_figures(by_round, disturbed))
        accuracy = {name: [rnd[name]["accuracy"] for _, rnd in sorted(by_round.items()) if name in rnd]
                    for name in ACCURACY_RUNS}
        entry["accuracy"] = {name: acc for name, acc in accuracy.items() if acc and None not in acc}
        for key, variant, reference in ACCURACY_PAIRS:
            paired = [rnd[variant]["accuracy"] - rnd[reference]["accuracy"] for rnd in by_round.values()
                      if variant in rnd and reference in rnd and None not in (rnd[variant]["accuracy"],
                                                                             rnd[reference]["accuracy"])]
            if paired:
                entry[key] = {**spread([100 * d for d in paired]), "mean": 100 * statistics.mean(paired)}
        alternate = next((r for r in ok if r["name"] == "alternate" and r.get("alternate")), None)
        if alternate:
            blocks = alternate["alternate"]
            _, aside = bench_load.screen_blocks(blocks, alternate.get("threads") or 1)
            named = [f"{b.get('round', 0)}:{b['steps'][0]}-{b['steps'][1]}" for b, _ in aside]
            kept = [all(b is not a for a, _ in aside) for b in blocks]
            entry["recipe_vs_hand_loop_same_process"] = spread([e["recipe"] / e["loop"] for e in blocks], named, kept,
                                                               interval=True)
            entry["trainer_vs_recipe_same_process"] = spread([e["trainer"] / e["recipe"] for e in blocks], named, kept,
                                                             interval=True)
        entry["disturbed"] = disturbance_summary(screened, alternate)
        first = by_round.get(0, {}).values()
        entry["memory_measured_vs_predicted"] = {r["name"]: r["memory_ratio"] for r in first if r["memory_ratio"]}
        full, lora = by_round.get(0, {}).get("single"), by_round.get(0, {}).get("lora")
        if full and lora and full.get("state_measured") and lora.get("state_measured"):
            entry["lora_state_vs_full"] = {"lora": lora["state_measured"], "full": full["state_measured"],
                                           "ratio": lora["state_measured"] / full["state_measured"],
                                           "lora_measured_vs_predicted": lora["memory_ratio"]}
        entry["comm_measured_vs_predicted"] = {r["name"]: r["comm_ratio"] for r in first if r.get("comm_ratio")}
        out[model] = entry
    return out


def disturbance_summary(screened: dict, alternate=None) -> dict:
    """What the rule set aside (bench_load): runs replaced by a repeat, runs still disturbed, and `alternate` blocks,
    each with why."""
    summary = {"measured": any(r.get("cpu_share") is not None for r in screened["kept"]),
               "repeated": [f"{bench_load.label(r)}: {why}" for r, why in screened["repeated"]],
               "set_aside": [f"{bench_load.label(r)}: {why}" for r, why in screened["disturbed"]]}
    if alternate:
        blocks = alternate["alternate"]
        _, aside = bench_load.screen_blocks(blocks, alternate.get("threads") or 1)
        summary["blocks"] = len(blocks)
        summary["blocks_set_aside"] = [f"round {b.get('round', 0)} steps {b['steps'][0]}-{b['steps'][1]}: {why}"
                                       for b, why in aside]
    return summary


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def unused_stem(directory: Path, stem: str, suffixes=(".json", ".md")) -> str:
    """`stem`, or `stem-2`, `stem-3`, ... where no file of these suffixes exists yet: a second check on the same day
    (a GPU lent twice) keeps the first one's results instead of overwriting the figures its pages cite."""
    name, n = stem, 1
    while any((directory / f"{name}{suffix}").exists() for suffix in suffixes):
        n += 1
        name = f"{stem}-{n}"
    return name


def mib(value):
    return None if value is None else value / MIB


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def first_round(runs: list) -> list:
    """Every run of round 0: one per strategy and baseline, all on seed 42 (the last attempt of a repeated one)."""
    return [r for r in latest(runs) if r.get("round", 0) == 0]


def latest(runs: list) -> list:
    """The runs less the attempts that a repeat replaced."""
    return bench_load.screen(runs)["kept"]


def markdown_table(results: dict) -> str:
    label = results["memory_label"]
    lines = [f"| model | run | procs | threads | precision | samples/s | tokens/s | real/padded | s/step median "
             f"| s/step p10 "
             f"| model state MiB/rank | predicted | measured/predicted | comm MiB/step/rank | predicted "
             f"| measured/predicted | {label} MiB | accuracy | MFU |",
             "|---|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in first_round(results["runs"]):
        if r["name"] == "alternate":  # epoch times only: in the ratios below
            continue
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['name']} | | | | {r['status']}: {r['reason']} |" + " |" * 13)
            continue
        peak = r["cuda_max_allocated"] if label == "CUDA max alloc" else r["peak_rss"]
        if label == "CUDA max alloc" and r.get("cuda_max_reserved"):
            peak_text = f"{peak / MIB:.0f} ({r['cuda_max_reserved'] / MIB:.0f} reserved)"
        else:
            peak_text = fmt(peak and peak / MIB, '.0f')
        lines.append(
            f"| {r['model']} | {r['name']} | {r['world']} | {r.get('threads') or '-'} | {r['precision']} "
            f"| {fmt(r['samples_per_s'], '.1f')} | {fmt(r['tokens_per_s'], '.0f')} "
            f"| {fmt(r.get('padding_efficiency'), '.3f')} | {fmt(r['step_time_s'], '.3f')} "
            f"| {fmt(r['fast_step_time_s'], '.3f')} "
            f"| {fmt(r['state_measured'] and r['state_measured'] / MIB, '.2f')} "
            f"| {fmt(r['state_predicted'] and r['state_predicted'] / MIB, '.2f')} | {fmt(r['memory_ratio'], '.3f')} "
            f"| {fmt(mib(r.get('comm_measured')), '.2f')} | {fmt(mib(r.get('comm_predicted')), '.2f')} "
            f"| {fmt(r.get('comm_ratio'), '.3f')} | {peak_text} | {fmt(r['accuracy'], '.3f')} "
            f"| {fmt(r.get('mfu') and 100 * r['mfu'], '.1f')}{'%' if r.get('mfu') else ''} |")
    return "\n".join(lines)


RATIO_TEXT = {"recipe_vs_hand_loop_same_process": "recipe / hand-written loop, same process",
              "trainer_vs_recipe_same_process": "Trainer / recipe, same process",
              "recipe_vs_hand_loop_time": "recipe (accelerate launch) / hand-written loop, separate processes",
              "trainer_vs_recipe_time": "Trainer / recipe (accelerate launch), separate processes",
              "pad128_vs_dynamic_time": "pad-to-128 / dynamic padding",
              "grouped_speedup_vs_pad128": "grouped batches' speed-up over pad-to-128",
              "grouped_speedup_vs_dynamic": "grouped batches' speed-up over dynamic padding",
              "padding_free_speedup_vs_dynamic": "padding-free batches' speed-up over dynamic padding",
              "padding_free_bound": "bound of that speed-up, P/R: positions dynamic padding computes / real tokens",
              "padding_free_fraction_of_bound": "padding-free batches' speed-up / its bound P/R",
              "padding_free_grouped_vs_grouped": "padding-free grouped batches' speed-up over grouped batches",
              "fused_adamw_speedup": "fused AdamW's speed-up over torch's per-parameter AdamW (recipe, epoch)",
              "sdpa_speedup_vs_eager": "SDPA attention's speed-up over eager attention (recipe, epoch)",
              "lora_speedup_vs_full": "LoRA (r 8)'s speed-up over full fine-tuning (recipe, epoch)"}


def goal_text(key: str, median: float) -> str:
    if key not in GOALS:
        return ""
    op, bound = GOALS[key]
    met = median <= bound if op == "<=" else median >= bound
    return f" (goal {op} {bound}: {'met' if met else 'NOT met'})"


def interval_text(key: str, ci95, verdicts: bool = True) -> str:
    """The median's 95% interval, and for a headline ratio its half-width against HALF_WIDTH_GOAL."""
    if not ci95:  # one round, or a results file from before the intervals (its records --rerender)
        return ""
    half = (ci95[1] - ci95[0]) / 2
    goal = (f", half-width {half:.3f} (goal <= {HALF_WIDTH_GOAL}: {'met' if half <= HALF_WIDTH_GOAL else 'NOT met'})"
            if key in HEADLINES and verdicts else "")
    return f"; 95% interval of the median {ci95[0]:.3f}-{ci95[1]:.3f}{goal}"


def ratio_lines(results: dict, verdicts: bool = True) -> list:
    """One line per ratio: the median over the interleaved rounds (or blocks), its min-max, its 95% interval and the
    goal. Without `verdicts` (the user page, docs/benchmark.md) the figures only: no goal, no runs repeated or set
    aside as disturbed; the results file beside it has both."""
    goal = goal_text if verdicts else (lambda key, median: "")
    lines = []
    for model, entry in results["ratios"].items():
        for key, text in RATIO_TEXT.items():
            r = entry.get(key)
            if not isinstance(r, dict):
                continue
            where = "blocks of steps taken in turn in one process" if key.endswith("same_process") \
                else "interleaved rounds"
            aside = r.get("set_aside") or []
            left_out = (f", {len(aside)} set aside as disturbed: " + ", ".join(map(str, aside))) if aside else ""
            left_out = "; every one disturbed, so all kept: not to be trusted" if r.get("all_disturbed") else left_out
            lines.append(f"- {model}, {text}: **{r['median']:.3f}x** (min {r['min']:.3f}, max {r['max']:.3f}; "
                         f"{r['rounds']} {where}{left_out}{interval_text(key, r.get('ci95'), verdicts)})"
                         f"{goal(key, r['median'])}")
        acc = entry.get("accuracy") or {}
        if acc:
            lines.append(f"- {model}, accuracy per round: " + "; ".join(
                f"{name} {', '.join(f'{a:.3f}' for a in values)}" for name, values in acc.items()))
        diff = entry.get("grouped_minus_dynamic_accuracy_points")
        if diff:
            within = abs(diff["mean"]) <= ACCURACY_POINTS
            verdict = f"; goal within {ACCURACY_POINTS}: {'met' if within else 'NOT met'}" if verdicts else ""
            lines.append(f"- {model}, grouped - dynamic accuracy: **{diff['mean']:+.2f} points** mean (min "
                         f"{diff['min']:+.2f}, max {diff['max']:+.2f}{verdict})")
        diff = entry.get("padding_free_minus_dynamic_accuracy_points")
        if diff:  # the same model per sequence; only dropout draws other numbers: no goal
            lines.append(f"- {model}, padding-free - dynamic accuracy: **{diff['mean']:+.2f} points** mean (min "
                         f"{diff['min']:+.2f}, max {diff['max']:+.2f}; {rounds(diff)}; dropout draws differently)")
        computed = entry.get("padding_free_real_vs_computed")
        if computed:
            every = all(r["min"] == r["max"] == 1 for r in computed.values())
            lines.append(f"- {model}, real / computed positions of the padding-free runs (tokens / padded_tokens of "
                         "their records): " + ", ".join(
                             f"{name} {r['min']:.3f}" + (f"-{r['max']:.3f}" if r["max"] != r["min"] else "")
                             + f" ({rounds(r)})" for name, r in computed.items())
                         + (f" (expected 1.000: {'met' if every else 'NOT met'})" if verdicts else ""))
        state = entry.get("lora_state_vs_full")
        if state:
            lines.append(f"- {model}, LoRA (r 8) / full fine-tuning, model state per rank: **{state['ratio']:.3f}x** "
                         f"({mib(state['lora']):.2f} / {mib(state['full']):.2f} MiB; LoRA measured / predicted "
                         f"{state['lora_measured_vs_predicted']:.3f})")
        if verdicts:
            lines += disturbance_lines(model, entry.get("disturbed"))
    return lines


def rounds(figure: dict) -> str:
    return f"{figure['rounds']} round" + ("s" if figure["rounds"] != 1 else "")


def disturbance_lines(model: str, summary) -> list:
    """The runs and blocks the disturbance rule repeated or set aside (bench_load), or that none were."""
    if not summary:
        return []
    rule = (f"CPU share < {bench_load.SHARE_FLOOR} x the best of the same run, or others' CPU > "
            f"{bench_load.OTHERS_CEILING} of the machine")
    lines = []
    for key, text in (("repeated", "launched again"), ("set_aside", "still disturbed, set aside")):
        if summary.get(key):
            lines.append(f"- {model}, disturbed runs {text} ({len(summary[key])}): " + "; ".join(summary[key]))
    if summary.get("blocks_set_aside"):
        lines.append(f"- {model}, disturbed same-process blocks, out of the ratios: "
                     f"{len(summary['blocks_set_aside'])} of {summary['blocks']}: "
                     + "; ".join(summary["blocks_set_aside"]))
    if not lines and summary.get("measured"):
        lines.append(f"- {model}, disturbed runs: none")
    return [*lines[:-1], f"{lines[-1]} (disturbed: {rule})"] if lines else []


def rounds_table(results: dict) -> list:
    """The interleaved runs round by round: seconds of the same samples, padding efficiency and accuracy."""
    screened = bench_load.screen(results["runs"])
    kept, disturbed = screened["kept"], {id(r) for r, _ in screened["disturbed"]}
    repeated = [r for r in kept if r["status"] == "ok" and r.get("round", 0) > 0]
    if not repeated:
        return []
    names = list(dict.fromkeys(r["name"] for r in repeated))
    lines = ["## Interleaved rounds", "",
             "The one-process runs, launched in rounds (A B C D E, then E D C B A, ...), round r with seed 42 + r "
             "(its own split, initialisation and order; within a round every run trains the same samples): seconds "
             "of the whole epoch, padding efficiency (real / padded tokens) and accuracy. The ratios above are "
             "taken within each round, less the runs set aside as disturbed (last column).", "",
             "| model | round | seed | " + " | ".join(f"{n} s" for n in names) + " | "
             + " | ".join(f"{n} acc" for n in names) + " | threads | set aside |",
             "|---|--:|--:|" + "--:|" * (2 * len(names)) + "--:|---|"]
    # a row per model and round that ran a repeated run (the quick profile's later rounds run only bench.HEADLINE)
    for model, round_ in dict.fromkeys((r["model"], r.get("round", 0)) for r in kept if r["name"] in names):
        rnd = {r["name"]: r for r in kept if r["model"] == model and r.get("round", 0) == round_}
        r0 = next(r for r in rnd.values() if r["name"] in names)
        cells = [fmt(rnd.get(n, {}).get("epoch_s"), ".2f") for n in names]
        cells += [fmt(rnd.get(n, {}).get("accuracy"), ".3f") for n in names]
        aside = ", ".join(n for n in names if id(rnd.get(n)) in disturbed) or "-"
        lines.append(f"| {model} | {round_} | {r0.get('seed', 42)} | " + " | ".join(cells)
                     + f" | {r0.get('threads')} | {aside} |")
    efficiency = {n: [r["padding_efficiency"] for r in results["runs"]
                      if r["name"] == n and r.get("padding_efficiency")] for n in names}
    lines += ["", "Padding efficiency (real / padded tokens, min-max over the rounds): " + "; ".join(
        f"{n} {min(v):.3f}-{max(v):.3f}" for n, v in efficiency.items() if v) + "."]
    for model, costs in (results.get("padding") or {}).items():  # counted in-process, no training
        lines += ["", f"{model}: real / padded tokens of one epoch's batches, to the longest vs rounded up to a "
                  "multiple of 8 (--pad_to_multiple_of 8): " + "; ".join(
                      f"{kind} {costs[kind]:.3f} -> {costs[kind + '_pad8']:.3f}" for kind in ("dynamic", "grouped")
                      if kind in costs and kind + "_pad8" in costs) + "."]
    return lines


def render_markdown(results: dict, chart_name: str) -> str:
    hw, v = results["hardware"], results["versions"]
    gpus = ", ".join(hw["gpus"]) or "none"
    when = (f"`{results.get('command', 'scripts/measure/bench.py')}`, started {results['started']}, took "
            f"{results['duration_s'] / 60:.1f} min.")
    if "rerendered" in results:
        when += f" Throughput and ratios recomputed from the same run records on {results['rerendered']}."
    lines = [f"# Benchmark {results['date']}: {hw['device']} on {hw['host']}", "", when, "",
             f"Hardware: {hw['cpu']}, {hw['cpu_cores']} cores, {hw.get('memory_gib', '?')} GiB RAM; GPUs: {gpus}.",
             "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".", "", "## Work", ""]
    for model, w in results["work"].items():
        batch = w.get("effective_batch")
        batches = (f"{w['per_device_batch']} samples per device (effective batch: "
                   + ", ".join(f"{k} {v}" for k, v in batch.items()) + ")") if isinstance(batch, dict) else \
            f"{batch} samples ({w.get('train_samples')} samples)"
        lines.append(f"- {model}: `{w['model']}`{' (random init)' if w['random_init'] else ''}, {w['precision']}, "
                     f"{w['steps']} optimizer steps of {batches}, one epoch, seed {w['seed']}, throughput after "
                     f"{w['warmup_steps']} warm-up steps, lr {w['learning_rate']}, eval on {w['eval_samples']} "
                     "samples.")
    lines += ["", "## Results", "", markdown_table(results), "",
              "Round 0 (seed 42) of every run. threads: intra-op threads per process (the machine's cores "
              "shared out). real/padded: real tokens / padded tokens, the share of computed positions that hold text. "
              "s/step: median time of one optimizer step after the warm-up; p10: its 10th percentile. samples/s and "
              "tokens/s: totals over all steps after the warm-up (tokens: non-pad). The ratios below compare the "
              "seconds of the whole epoch within each interleaved round, except the same-process ones: the recipe, "
              "the loop and Trainer in threads of one process taking turns every 5 steps on the same batches, "
              "compared block by block (scripts/measure/bench_baselines.py alternate). MFU: model FLOP/s "
              "(6 x parameters x tokens/s, plus attention) over the peak of the devices the run used: the data-sheet "
              "peak of the GPU, "
              "or on CPU the best rate of a 1024 x 1024 matmul on the run's threads"
              + (" (" + ", ".join(f"{k}: {v / 1e9:.1f} GFLOP/s" for k, v in results["peak_flops"].items()) + ")"
                 if results.get("peak_flops") else "") + ".", "",
              "Model state: bytes of all live tensors on the largest rank after training and the final evaluation "
              "(recipes/model/memstats.py), against scripts/memory_model.py on the same basis. "
              f"{results['memory_label']}: the whole process (interpreter, libraries, activations), not model state.",
              "", *comm_section(results), "", "## Ratios", "", *ratio_lines(results), "", *rounds_table(results), "",
              f"![throughput and memory]({chart_name})", "",
              "## Memory breakdown (MiB per rank, measured / predicted)", "",
              "| model | run | parameters | optimizer state | gradients + other buffers |", "|---|---|--:|--:|--:|"]
    for r in first_round(results["runs"]):
        b = r["breakdown"]
        if b:
            cells = " | ".join(f"{b[k][0] / MIB:.2f} / {b[k][1] / MIB:.2f}"
                               for k in ("parameters", "optimizer_state", "gradients_and_other"))
            lines.append(f"| {r['model']} | {r['name']} | {cells} |")
    lines += ["", "The resolved configuration of every run (run_config.json, and the DeepSpeed JSON it used) is in "
              "the .json file beside this one."]
    return "\n".join(lines) + "\n"


def comm_section(results: dict) -> list:
    """Bytes sent per rank per optimizer step, by kind of collective, measured / textbook, and why a run departs."""
    lines = ["## Communication per optimizer step (MiB sent per rank, measured / textbook)", "",
             "Counted by recipes/testing/commstats.py (every c10d and functional collective, DDP's C++ ones "
             "included) in the "
             "probe's steps 3-6 without an evaluation; convention: the bytes a rank sends on average with ring and "
             "chain algorithms, all-reduce 2 (n-1)/n x S, all-gather and reduce-scatter (n-1)/n x S (S the whole "
             "tensor), broadcast and reduce (n-1)/n x S. Textbook (scripts/memory_model.py comm_bytes_per_step): "
             "DDP and ZeRO-1/2 2 psi (n-1)/n, ZeRO-3 and FSDP2 3 psi (n-1)/n, psi the parameter bytes in the "
             "communicated dtype (DDP: fp32 gradients).", "", "| model | run | collective | measured | textbook |",
             "|---|---|---|--:|--:|"]
    notes = []
    for r in first_round(results["runs"]):
        for kind, (measured, predicted) in (r.get("comm_breakdown") or {}).items():
            lines.append(f"| {r['model']} | {r['name']} | {kind} | {measured / MIB:.3f} | {predicted / MIB:.3f} |")
        ratio = r.get("comm_ratio")
        if ratio is not None and abs(ratio - 1) > COMM_TOLERANCE:
            why = COMM_NOTES.get(r["name"], "not explained yet: see the breakdown above")
            notes.append(f"- {r['model']} {r['name']}: measured / textbook {ratio:.3f}. {why}")
    return lines + ([""] + notes if notes else [])


def render_chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["work"])
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 3.8 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        runs = [r for r in first_round(results["runs"]) if r["model"] == model and r["status"] == "ok"
                and r.get("samples_per_s")]
        names = [r["name"] for r in runs]
        x = range(len(runs))
        bars = row[0].bar(x, [r["samples_per_s"] for r in runs],
                          color=["tab:blue" if r["kind"] == "strategy" else "tab:gray" for r in runs])
        row[0].bar_label(bars, fmt="%.0f", fontsize=8)
        row[0].set_title(f"{model}: samples/s after warm-up (gray: baselines)")
        row[0].set_ylabel("samples / s")
        measured = [(r["state_measured"] or 0) / MIB for r in runs]
        predicted = [(r["state_predicted"] or 0) / MIB for r in runs]
        bars = row[1].bar([i - 0.2 for i in x], measured, width=0.4, label="measured", color="tab:green")
        row[1].bar([i + 0.2 for i in x], predicted, width=0.4, label="predicted", color="tab:olive")
        row[1].bar_label(bars, labels=[f"{r['memory_ratio']:.2f}x" if r["memory_ratio"] else "" for r in runs],
                         fontsize=8)
        row[1].set_yscale("log")
        values = [v for v in measured + predicted if v > 0] or [1.0]
        row[1].set_ylim(10 ** math.floor(math.log10(min(values))), 10 ** math.ceil(math.log10(max(values) * 3)))
        row[1].set_title(f"{model}: model state per rank, MiB (label: measured / predicted)")
        row[1].set_ylabel("MiB (log scale)")
        row[1].legend(loc="upper left")
        for ax in row:
            ax.set_xticks(list(x))
            ax.set_xticklabels(names, rotation=30, ha="right")
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"make bench {results['date']}: {results['hardware']['device']} on {results['hardware']['host']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: dict, results_dir: Path, replace: bool = False) -> dict:
    """results/<date>_<device>_<host>.{json,md,png} (<date>_<tag>_<device>_<host> for a tagged measurement), or -2,
    -3, ... after the name where a bench of the same day wrote one (the pages cite each file's figures); `replace` (a
    --rerender of that file) writes over it. Returns the paths."""
    results_dir.mkdir(parents=True, exist_ok=True)
    hw = results["hardware"]
    tag = f"{slug(results['tag'])}_" if results.get("tag") else ""
    stem = f"{results['date']}_{tag}{slug(hw['device'])}_{slug(hw['host'])}"
    stem = stem if replace else unused_stem(results_dir, stem, (".json", ".md", ".png"))
    paths = {ext: results_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    render_chart(results, paths["png"])
    paths["md"].write_text(render_markdown(results, paths["png"].name))
    return paths


def update_readme(readme: Path, results: dict, paths: dict) -> bool:
    """Replace the block between the bench markers of `readme` (docs/benchmark.md for `make bench`) with the latest
    table, and say so; False (and a note) when there is no such file or no markers."""
    if not readme.exists():
        print(f"note: {readme.name} does not exist yet; the bench block is not written")
        return False
    text = readme.read_text()
    if README_START not in text or README_END not in text:
        print(f"note: {readme.name} has no {README_START} ... {README_END} markers; the bench block is not written")
        return False
    def link(path: Path) -> str:
        return os.path.relpath(path, readme.parent)

    block = "\n".join([
        README_START,
        f"Latest `make bench` ({results['date']}, {results['hardware']['device']}, "
        f"[full results]({link(paths['md'])}), with each goal's verdict and the runs repeated or set aside as "
        "disturbed):", "", markdown_table(results), "", *ratio_lines(results, verdicts=False), "",
        f"![throughput and memory]({link(paths['png'])})", README_END])
    head, rest = text.split(README_START, 1)
    readme.write_text(head + block + rest.split(README_END, 1)[1])
    print(f"rewrote the bench block of {readme}")
    return True


def rerender(results_json: Path) -> dict:
    """A results file recomputed from the records of its runs with this version of the analysis; launches nothing."""
    results = json.loads(results_json.read_text())
    for r in results["runs"]:
        if r["status"] == "ok" and not r.get("alternate"):
            metrics = read_jsonl(REPO / r["run_dir"] / "metrics.jsonl")
            tokens_per_s = r.get("tokens_per_s")
            r.update(throughput(metrics, results["work"][r["model"]]["warmup_steps"]))
            r.update(epoch_figures(metrics))
            if r.get("model_flops_per_s") and tokens_per_s:  # model FLOP/s are proportional to tokens/s
                r["model_flops_per_s"] *= r["tokens_per_s"] / tokens_per_s
        if r["status"] == "ok" and r.get("model_flops_per_s") and results["hardware"]["device"] == "cpu":
            # MFU over the peak of every process's threads (scripts/measure/bench.py compute_devices)
            peak = (results.get("peak_flops") or {}).get(f"{r['precision']} x{r['threads']} threads")
            r["mfu"] = r["model_flops_per_s"] / (peak * r["world"]) if peak else None
    results["ratios"] = ratios(results["runs"])
    results["rerendered"] = dt.datetime.now().isoformat(timespec="seconds")
    return results
