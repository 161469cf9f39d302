"""A sweep of the recipe over flag values and seeds: each trial a fresh launch of recipes/cls.py, the study in Optuna's
storage, resumable after a kill, a report with confidence intervals over seeds (docs/sweeps.md).

    python scripts/sweep.py --space scripts/sweep_example.yaml --seeds 3 --output_dir runs/sweep \\
        [--config_file accelerate_configs/ddp.yaml] [--trials K] [--prune] [-- fixed recipe flags]

SPACE maps recipe flag names to a list (grid values) or to {low, high, log} (a range, searched by Optuna's TPE).
A trial's folder is named by its configuration and seed (<output_dir>/trials/<flag>=<value>,...,seed=<s>); every
launch passes --resume_from_checkpoint auto, so a trial left RUNNING by a killed sweep continues from its newest
checkpoint. The sweep only launches the recipe and reads its files (eval.jsonl, metrics.jsonl, final/).
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STUDY = "sweep"
LOCK = "sweep.lock"  # in the trial's folder: held by the trial's process group while it trains
LOG = "sweep.log"  # the trial's stdout and stderr, appended per launch
LAUNCH_MARK = "sweep: launch\n"  # in LOG before each launch


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    fixed = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--space", help="YAML: recipe flag -> list of values (grid) or {low, high, log} (range, TPE)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per configuration: 42, 43, ...")
    p.add_argument("--output_dir", required=True, help="the sweep folder: trials/, the storage, the report")
    p.add_argument("--config_file", help="accelerate config: each trial is `accelerate launch --config_file ...`; "
                                         "none: one plain `python recipes/cls.py` process")
    p.add_argument("--num_processes", type=int, help="passed to accelerate launch")
    p.add_argument("--trials", type=int, help="budget in trials (launches of a configuration and seed); "
                                              "default: the whole grid, required for ranges")
    p.add_argument("--metric", default="accuracy", help="the eval.jsonl key scored; names ending in loss are minimised")
    p.add_argument("--storage", help="Optuna storage URL (default sqlite:///<output_dir>/study.db); "
                                     "postgresql://... or mysql://... for a sweep over several machines")
    p.add_argument("--prune", action="store_true", help="stop trials below the median at an evaluation (Optuna's "
                                                        "MedianPruner), through the recipe's SIGTERM checkpoint")
    p.add_argument("--no_wait", action="store_true", help="stop, rather than wait, when a trial's folder is held by "
                                                          "a live process of an earlier sweep")
    p.add_argument("--report", action="store_true", help="only rebuild the report from the storage")
    args = p.parse_args(argv)
    args.fixed = fixed
    if not args.report and not args.space:
        p.error("--space is required (except with --report)")
    return args


# --- the space -----------------------------------------------------------------------------------------------------
def load_space(path: str) -> dict:
    import yaml

    space = yaml.safe_load(Path(path).read_text())
    if not isinstance(space, dict) or not space:
        fail(f"--space {path}: expected a mapping of recipe flag names to a list or {{low, high, log}}")
    for name, values in space.items():
        ok = (isinstance(values, list) and values) or (isinstance(values, dict) and {"low", "high"} <= set(values))
        if not ok:
            fail(f"--space {path}: {name}: expected a non-empty list or {{low, high, log}}, got {values!r}")
        if isinstance(values, list):  # PyYAML 6 reads 1e-3 (no dot) as a string: numbers stay numbers here
            space[name] = [number(v) for v in values]
    return space


def number(value):
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def distributions(space: dict) -> dict:
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    return {name: CategoricalDistribution(values) if isinstance(values, list)
            else FloatDistribution(float(values["low"]), float(values["high"]), log=bool(values.get("log", False)))
            for name, values in space.items()}


def trial_name(config: dict, seed: int) -> str:
    """The folder of a configuration and seed: the same on every restart, whatever the trial's number."""
    return ",".join(f"{flag}={value}" for flag, value in sorted(config.items())) + f",seed={seed}"


def recipe_command(config_file, num_processes, fixed: list, config: dict, seed: int, out: Path) -> list[str]:
    if config_file:
        head = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", config_file]
        head += ["--num_processes", str(num_processes)] if num_processes else []
        head += ["recipes/cls.py"]
    else:
        head = [sys.executable, "recipes/cls.py"]
    flags = [item for flag, value in config.items() for item in (f"--{flag}", str(value))]
    return [*head, *fixed, *flags, "--seed", str(seed), "--output_dir", str(out), "--resume_from_checkpoint", "auto"]


# --- a trial's files -----------------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return rows


def finished_on_disk(folder: Path) -> bool:
    """final/ is there and the last evaluation is of the last logged step."""
    evals, steps = read_jsonl(folder / "eval.jsonl"), read_jsonl(folder / "metrics.jsonl")
    return (folder / "final").is_dir() and bool(evals) and bool(steps) and evals[-1]["step"] == steps[-1]["step"]


def error_line(log_text: str) -> str:
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")


def _die_with_parent() -> None:
    """In the trial's launcher: SIGTERM when the sweep dies (even by SIGKILL), so that the trial stops through the
    recipe's own checkpoint-and-stop path instead of training on unowned (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def live_group(folder: Path) -> int | None:
    """The process group of a leftover still holding `folder` (its lock held, or its group alive), else None."""
    lock = folder / LOCK
    if not lock.exists():
        return None
    try:
        pgid = json.loads(lock.read_text() or "{}").get("pgid")
    except ValueError:
        pgid = None
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(handle, fcntl.LOCK_UN)
        except BlockingIOError:
            return pgid or -1
    if pgid:
        try:
            os.killpg(pgid, 0)
            return pgid
        except (ProcessLookupError, PermissionError):
            return None
    return None


class Runner:
    def __init__(self, args, study, space: dict):
        self.args, self.study, self.space = args, study, space
        self.root = Path(args.output_dir).resolve()
        self.current = None  # the running trial's Popen
        self.recipe_seconds = 0.0

    def run_trial(self, trial, config: dict, seed: int) -> None:
        """Launch (or continue) one trial in its folder and tell the storage how it ended."""
        import optuna

        folder = self.root / "trials" / trial_name(config, seed)
        folder.mkdir(parents=True, exist_ok=True)
        leftover = live_group(folder)
        while leftover:
            if self.args.no_wait:
                fail(f"{folder} is held by a live process group {leftover} of an earlier sweep: stop it, or run "
                     "without --no_wait to wait for it")
            print(f"sweep: waiting for process group {leftover}, still in {folder}", flush=True)
            time.sleep(1.0)
            leftover = live_group(folder)
        cmd = recipe_command(self.args.config_file, self.args.num_processes, self.args.fixed, config, seed, folder)
        trial.set_user_attr("command", cmd)
        if finished_on_disk(folder):  # it ended after its sweep died, before the sweep could record it
            self.record(trial, folder, optuna.trial.TrialState.COMPLETE)
            return
        resumed = (folder / "checkpoints" / "latest").exists()
        print(f"sweep: trial {trial.number} {folder.name}{' (resumed)' if resumed else ''}", flush=True)
        lock = open(folder / LOCK, "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.perf_counter()
        with open(folder / LOG, "a") as log:
            log.write(LAUNCH_MARK)
            log.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=(lock.fileno(),), preexec_fn=_die_with_parent)
            self.current = proc
            lock.write(json.dumps({"pgid": proc.pid, "sweep_pid": os.getpid()}))
            lock.flush()
            pruned = self.watch(trial, proc, folder)
        self.current = None
        self.recipe_seconds += time.perf_counter() - started
        lock.close()
        log_text = (folder / LOG).read_text()
        if pruned:
            marker = folder / "checkpoints" / "PREEMPTED"
            trial.set_user_attr("pruned_at", marker.read_text().strip() if marker.exists() else None)
            self.record(trial, folder, optuna.trial.TrialState.PRUNED)
        elif finished_on_disk(folder):
            self.record(trial, folder, optuna.trial.TrialState.COMPLETE)
        else:
            trial.set_user_attr("error", error_line(log_text.split(LAUNCH_MARK)[-1]))
            self.study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            print(f"sweep: trial {trial.number} failed: {trial.user_attrs['error']}", flush=True)

    def watch(self, trial, proc, folder: Path) -> bool:
        """Report each new evaluation; with --prune, SIGTERM the trial when the pruner says so. True when pruned."""
        seen, pruned = 0, False
        reported = trial.storage_intermediate()  # read once: the pruner's decision must come quickly after an eval
        while True:
            done = proc.poll() is not None
            evals = read_jsonl(folder / "eval.jsonl")
            for record in evals[seen:]:
                if self.args.metric in record and record["step"] not in reported:
                    trial.report(float(record[self.args.metric]), record["step"])
                    reported.add(record["step"])
                    if self.args.prune and not done and not pruned and trial.should_prune():
                        print(f"sweep: pruning trial {trial.number} at step {record['step']}", flush=True)
                        os.killpg(proc.pid, signal.SIGTERM)  # the recipe's stop path: checkpoint, PREEMPTED marker
                        pruned = True
            seen = len(evals)
            if done:
                return pruned
            time.sleep(0.05)

    def record(self, trial, folder: Path, state) -> None:
        value = None
        if state.name == "COMPLETE":
            for record in read_jsonl(folder / "eval.jsonl"):
                if self.args.metric in record and record["step"] not in trial.storage_intermediate():
                    trial.report(float(record[self.args.metric]), record["step"])
            last = read_jsonl(folder / "eval.jsonl")[-1]
            if self.args.metric not in last:
                trial.set_user_attr("error", f"error: eval.jsonl has no {self.args.metric!r}: {sorted(last)}")
                self.study.tell(trial.number, state=type(state).FAIL)
                return
            value = float(last[self.args.metric])
        self.study.tell(trial.number, value, state=state)
        print(f"sweep: trial {trial.number} {state.name.lower()}" + (f" {self.args.metric} {value:.6g}"
                                                                     if value is not None else ""), flush=True)


class _Trial:
    """optuna.trial.Trial plus the intermediate steps already stored (a resumed trial reports only new ones)."""

    def __init__(self, trial):
        self._trial = trial

    def __getattr__(self, name):
        return getattr(self._trial, name)

    def storage_intermediate(self) -> set:
        frozen = [t for t in self._trial.study.get_trials(deepcopy=False) if t.number == self._trial.number][0]
        return set(frozen.intermediate_values)


def reopen(study, frozen):
    """A Trial object for a RUNNING trial that a killed sweep left: Optuna 5.0.0 has no public call returning one by
    number (study.ask only makes new trials), so it is built from FrozenTrial._trial_id as Study.ask builds it."""
    import optuna

    return optuna.trial.Trial(study, frozen._trial_id)


def open_study(args, space=None):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    root = Path(args.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{root / 'study.db'}"
    pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0) if getattr(args, "prune", False) \
        else optuna.pruners.NopPruner()
    if args.report:
        return optuna.load_study(study_name=STUDY, storage=storage, pruner=pruner)
    direction = "maximize" if not args.metric.endswith("loss") else "minimize"
    grid = all(isinstance(v, list) for v in space.values())
    sampler = optuna.samplers.TPESampler(seed=0) if not grid else None
    study = optuna.create_study(study_name=STUDY, storage=storage, direction=direction, load_if_exists=True,
                                sampler=sampler, pruner=pruner)
    setup = {"space": space, "seeds": args.seeds, "fixed": args.fixed, "metric": args.metric,
             "config_file": args.config_file, "num_processes": args.num_processes}
    # More grid values or seeds extend a sweep (its finished trials stay); anything else that shapes a trial is
    # another sweep: refused here, before the storage is written to.
    before, now = study.user_attrs.get("setup"), json.loads(json.dumps(setup))
    shape = ("fixed", "metric", "config_file", "num_processes")
    changed = [f"{k} {json.dumps(before[k])} -> {json.dumps(now[k])}" for k in shape if before and before[k] != now[k]]
    changed += space_changes(before["space"], now["space"]) if before else []
    if changed:
        fail(f"{storage} holds a sweep of another setup: {'; '.join(changed)}; only more grid values or more seeds "
             "extend a sweep: give this one another --output_dir")
    study.set_user_attr("setup", setup)
    return study


def space_changes(before: dict, now: dict) -> list[str]:
    """What a new space changes of the one a sweep was started with, other than grid values added."""
    changed = [f"{name} added" for name in now if name not in before]
    changed += [f"{name} removed" for name in before if name not in now]
    for name in (n for n in now if n in before):
        old, new = before[name], now[name]
        if isinstance(old, list) and isinstance(new, list):
            gone = [v for v in old if v not in new]
            if gone:
                changed.append(f"{name} values {json.dumps(gone)} removed")
        elif old != new:
            changed.append(f"{name} {json.dumps(old)} -> {json.dumps(new)}")
    return changed


def plan(args, study, space: dict):
    """(trial, config, seed) to run, in order: RUNNING leftovers first, then new ones up to the budget."""
    import optuna

    seeds = [42 + i for i in range(args.seeds)]
    trials = study.get_trials(deepcopy=False)
    by_name = {t.user_attrs.get("name"): t for t in trials}
    for frozen in trials:
        if frozen.state == optuna.trial.TrialState.RUNNING and "name" not in frozen.user_attrs:
            study.tell(frozen.number, state=optuna.trial.TrialState.FAIL)  # killed between ask and its launch
        elif frozen.state == optuna.trial.TrialState.RUNNING:
            yield _Trial(reopen(study, frozen)), frozen.user_attrs["config"], frozen.user_attrs["seed"]
    grid = all(isinstance(v, list) for v in space.values())
    if args.trials is None and not grid:
        fail("--trials is required when the space has a range ({low, high, log})")
    budget = args.trials if args.trials is not None else math.inf  # a grid: every configuration and seed
    dists = distributions(space)
    if grid:
        configs = [dict(zip(space, values)) for values in itertools.product(*space.values())]
    else:  # TPE: a restarted sweep first gives the configurations chosen before their missing seeds
        configs = []
        for frozen in trials:
            if "config" in frozen.user_attrs and frozen.user_attrs["config"] not in configs:
                configs.append(frozen.user_attrs["config"])
    started = len(trials)
    pending = [(config, seed) for config in configs for seed in seeds]
    while started < budget:
        if not pending and not grid:  # TPE picks a configuration; every seed of it follows
            trial = _Trial(study.ask(dists))
            config = dict(trial.params)
            pending = [(config, seed) for seed in seeds]
            config, seed = pending.pop(0)
            if trial_name(config, seed) in by_name:
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
                continue
        else:
            if not pending:
                break
            config, seed = pending.pop(0)
            if trial_name(config, seed) in by_name:
                continue
            if grid:
                # Optuna 5.0.0 refuses a CategoricalDistribution whose choices change within a study ("does not
                # support dynamic value space"): a grid's values live in the trial's user attributes instead, so that
                # more values can extend a sweep.
                trial = _Trial(study.ask())
            else:  # the other seeds of the configuration TPE chose
                study.enqueue_trial(config)
                trial = _Trial(study.ask(dists))
        name = trial_name(config, seed)
        for key, value in (("name", name), ("config", config), ("seed", seed)):
            trial.set_user_attr(key, value)
        by_name[name] = trial
        started += 1
        yield trial, config, seed


# --- the report ----------------------------------------------------------------------------------------------------
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: bisection on the CDF, the density integrated by Simpson's rule (no SciPy needed)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float) -> float:  # for x >= 0; the integrand in u = atan(t) keeps heavy tails finite
        n, b = 2000, math.atan(x)
        f = [c * (1 + math.tan(u) ** 2 / df) ** (-(df + 1) / 2) / math.cos(u) ** 2
             for u in (b * i / n for i in range(n + 1))]
        return 0.5 + b / n / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1e4
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


# The range of each bounded score eval.jsonl reports (recipes/metrics); a further evaluation set's prefix them
# (mismatched_accuracy).
BOUNDS = {**dict.fromkeys(("accuracy", "f1_macro", "f1", "micro_f1", "macro_f1", "exact_match"), (0.0, 1.0)),
          **dict.fromkeys(("matthews_correlation", "pearson", "spearman"), (-1.0, 1.0))}


def metric_bounds(metric: str) -> tuple[float, float] | None:
    """The range a metric's values lie in (None: unbounded, e.g. a loss)."""
    return BOUNDS.get(metric) or next((b for name, b in BOUNDS.items() if metric.endswith("_" + name)
                                       and metric[:-len(name) - 1] not in BOUNDS), None)


def summary(values: list[float], bounds: tuple[float, float] | None = None) -> dict:
    """Mean, sample standard deviation and the 95% Student's t interval over n seeds (n = 1: no interval). With
    `bounds`, the interval is cut to the metric's range (the t interval assumes an unbounded normal mean: a few seeds
    near 1 would otherwise reach past it), and `ci95_clipped` says whether it was."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"n": n, "mean": mean, "std": None, "ci95": None}
    std = statistics.stdev(values)
    half = t_quantile(0.975, n - 1) * std / math.sqrt(n)
    low, high = mean - half, mean + half
    if bounds is None:
        return {"n": n, "mean": mean, "std": std, "ci95": [low, high]}
    clipped = [max(low, bounds[0]), min(high, bounds[1])]
    return {"n": n, "mean": mean, "std": std, "ci95": clipped, "ci95_clipped": clipped != [low, high]}


def build_report(study, out: Path) -> dict:
    import optuna

    setup = study.user_attrs["setup"]
    metric, space = setup["metric"], setup["space"]
    maximize = not metric.endswith("loss")
    per_config: dict[str, dict] = {}
    trials = []
    for t in study.get_trials(deepcopy=False):
        if "name" not in t.user_attrs:
            continue
        row = {"number": t.number, "name": t.user_attrs["name"], "config": t.user_attrs["config"],
               "seed": t.user_attrs["seed"], "state": t.state.name, "value": t.value,
               "error": t.user_attrs.get("error"), "pruned_at": t.user_attrs.get("pruned_at")}
        trials.append(row)
        key = json.dumps(row["config"], sort_keys=True)
        entry = per_config.setdefault(key, {"config": row["config"], "values": {}, "command": None})
        if t.state == optuna.trial.TrialState.COMPLETE:
            entry["values"][str(row["seed"])] = t.value
            entry["command"] = entry["command"] or t.user_attrs.get("command")
    bounds = metric_bounds(metric)
    configs = [dict(e, **summary(list(e["values"].values()), bounds)) for e in per_config.values() if e["values"]]
    configs.sort(key=lambda e: -e["mean"] if maximize else e["mean"])
    best = configs[0] if configs else None
    for entry in configs[1:]:
        seeds = sorted(set(best["values"]) & set(entry["values"]), key=int)
        diffs = [best["values"][s] - entry["values"][s] for s in seeds]
        entry["paired_difference"] = dict(summary(diffs), seeds=[int(s) for s in seeds]) if diffs else None
    interval = "95% Student's t over seeds" + (f", cut to the metric's range [{bounds[0]:g}, {bounds[1]:g}]"
                                                  if bounds else "")
    report = {"metric": metric, "greater_is_better": maximize, "interval": interval, "bounds": bounds,
              "space": space, "seeds": setup["seeds"], "configurations": configs, "trials": trials,
              "best": {"config": best["config"], "command": best["command"]} if best else None}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    if configs:
        plot(report, out / "report.png")
    return report


def fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def markdown(report: dict) -> str:
    m = report["metric"]
    lines = [f"# Sweep report: {m} ({'higher' if report['greater_is_better'] else 'lower'} is better)", "",
             "Per configuration: mean, sample standard deviation and 95% confidence interval over the seeds "
             "(Student's t with n - 1 degrees of freedom; n = 1 gives no interval"
             + (f"; an interval reaching past the metric's range [{report['bounds'][0]:g}, {report['bounds'][1]:g}] "
                "is cut at its end, marked *" if report.get("bounds") else "")
             + "). Paired difference: the best configuration minus this one, seed by seed over the seeds both have "
             "(not cut: a difference may take either sign).", "",
             "| configuration | n | mean | std | 95% CI | best - this (paired, 95% CI) |", "|---|---|---|---|---|---|"]
    for e in report["configurations"]:
        ci = "-" if e["ci95"] is None else f"[{fmt(e['ci95'][0])}, {fmt(e['ci95'][1])}]" + (
            "*" if e.get("ci95_clipped") else "")
        d = e.get("paired_difference")
        diff = "(best)" if e is report["configurations"][0] else "-" if not d else (
            f"{fmt(d['mean'])}" + ("" if d["ci95"] is None else f" [{fmt(d['ci95'][0])}, {fmt(d['ci95'][1])}]"))
        label = ", ".join(f"{k}={v}" for k, v in sorted(e["config"].items()))
        lines.append(f"| {label} | {e['n']} | {fmt(e['mean'])} | {fmt(e['std'])} | {ci} | {diff} |")
    if report["best"]:
        lines += ["", "Best configuration's command (one seed):", "", "```", " ".join(report["best"]["command"]), "```"]
    odd = [t for t in report["trials"] if t["state"] != "COMPLETE"]
    if odd:
        lines += ["", "| trial | state | detail |", "|---|---|---|"]
        lines += [f"| {t['name']} | {t['state']} | {t['error'] or t['pruned_at'] or ''} |" for t in odd]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = report["configurations"]
    flags = sorted(report["space"])
    fig, ax = plt.subplots(figsize=(6, 4))
    numeric = len(flags) == 1 and all(isinstance(e["config"][flags[0]], (int, float)) for e in configs)
    xs = [e["config"][flags[0]] for e in configs] if numeric else list(range(len(configs)))
    for x, e in zip(xs, configs):
        err = [[e["mean"] - e["ci95"][0]], [e["ci95"][1] - e["mean"]]] if e["ci95"] else None
        ax.errorbar([x], [e["mean"]], yerr=err, fmt="o", capsize=4, color="C0")
    if numeric:
        ax.set_xlabel(flags[0])
        if min(xs) > 0 and max(xs) / min(xs) >= 10:
            ax.set_xscale("log")
    else:
        ax.set_xticks(xs, [", ".join(f"{k}={v}" for k, v in sorted(e["config"].items())) for e in configs],
                      rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"{report['metric']} (mean, 95% t interval)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import optuna  # noqa: F401
        import yaml  # noqa: F401
    except ImportError:
        fail("the sweep needs Optuna: pip install -e .[sweep]")
    out = Path(args.output_dir).resolve()
    if args.report:
        report = build_report(open_study(args), out)
        print(f"sweep: report of {len(report['trials'])} trials in {out / 'report.md'}")
        return 0
    space = load_space(args.space)
    study = open_study(args, space)
    runner = Runner(args, study, space)

    def stop(signum, frame):  # the trial stops through its own checkpoint path and stays RUNNING: a rerun resumes it
        if runner.current is not None:
            os.killpg(runner.current.pid, signal.SIGTERM)
            runner.current.wait()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    started, n = time.perf_counter(), 0
    for trial, config, seed in plan(args, study, space):
        runner.run_trial(trial, config, seed)
        n += 1
    wall = time.perf_counter() - started
    if n:
        print(f"sweep: {n} trials in {wall:.1f} s, recipe {runner.recipe_seconds:.1f} s: runner overhead "
              f"{(wall - runner.recipe_seconds) / n:.2f} s per trial", flush=True)
    report = build_report(study, out)
    best = report["configurations"][0] if report["configurations"] else None
    if best:
        print(f"sweep: best {best['config']} {args.metric} mean {best['mean']:.4f} over {best['n']} seeds; "
              f"report in {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
