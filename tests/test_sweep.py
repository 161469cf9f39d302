"""scripts/sweep.py: a 2-rate x 2-seed grid of the tiny model (the uninterrupted reference), a hand run of one trial's
command, a sweep SIGKILLed after its first trial's checkpoint and run again, a pruned and a failed trial.

Recipe launches, one process each (plain `python recipes/cls.py`): 4 (reference) + 1 (hand run) + 2 (the killed
trial and its resumption; the killed sweep's other three trial folders are copies of the reference's, which the
restarted sweep must take as finished from their files without launching them) + 2 (pruned, failed) = 9.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import PYTHON, REPO, TINY, python, read_jsonl, run_in_own_group
from scripts import sweep

# 8 optimizer steps of 8 samples, evaluations at steps 3, 6 and 8 on 32 examples, a checkpoint every 2 steps. The
# score is the evaluation loss: continuous, so equalities between runs compare real numbers.
FIXED = ["--model_name_or_path", str(TINY), "--max_train_samples", "64", "--max_eval_samples", "32",
         "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16", "--cpu_threads", "1",
         "--max_train_steps", "8", "--eval_steps", "3", "--checkpointing_steps", "2", "--logging_steps", "1"]
RATES = [1e-3, 3e-3]
FIRST = "learning_rate=0.001,seed=42"  # the grid's first trial: the one the kill test interrupts


def sweep_cmd(out: Path, space: Path, seeds: int = 2, *extra: str, interpreter: str = "") -> list[str]:
    """The sweep's command; `interpreter` default helpers.python(), whose fork of the prewarm server starts its trials
    through the shim too (their recorded commands then begin with the shim)."""
    return [interpreter or python(), "scripts/sweep.py", "--space", str(space), "--seeds", str(seeds), "--output_dir",
            str(out), "--metric", "loss", *extra, "--", *FIXED]


def run_sweep(cmd: list[str], timeout: float = 400, env=None) -> subprocess.CompletedProcess:
    proc = run_in_own_group(cmd, timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("space") / "space.yaml"
    path.write_text("learning_rate: [1e-3, 3e-3]\n")  # 1e-3 without a dot: PyYAML's string, read as a number
    return path


@pytest.fixture(scope="module")
def reference(tiny_model, space, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep_ref")
    started = time.perf_counter()
    proc = run_sweep(sweep_cmd(out, space))
    print(f"reference sweep: 4 trials in {time.perf_counter() - started:.1f} s\n{proc.stdout}")
    return out, proc


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def launches(folder: Path) -> list[str]:
    """The output of each launch of a trial, in order (the runner marks each launch in the trial's log)."""
    return (folder / sweep.LOG).read_text().split(sweep.LAUNCH_MARK)[1:]


def test_t_quantile_matches_the_tables():
    for df, table in ((1, 12.706204736), (2, 4.302652730), (4, 2.776445105), (30, 2.042272456)):
        assert sweep.t_quantile(0.975, df) == pytest.approx(table, abs=1e-6)
    assert sweep.summary([0.5]) == {"n": 1, "mean": 0.5, "std": None, "ci95": None}  # one seed: no interval


def test_grid_trials_equal_hand_runs_and_the_report_recomputes(reference, tmp_path):
    out, proc = reference
    rep = report(out)
    trials = {t["name"]: t for t in rep["trials"]}
    assert sorted(trials) == sorted(f"learning_rate={r},seed={s}" for r in RATES for s in (42, 43))
    assert {t["state"] for t in trials.values()} == {"COMPLETE"}
    study_cmds = {}
    for name, t in trials.items():
        folder = out / "trials" / name
        evals = read_jsonl(folder / "eval.jsonl")
        assert [e["step"] for e in evals] == [3, 6, 8] and (folder / "final").is_dir()
        assert t["value"] == evals[-1]["loss"]  # the storage holds the trial's own last evaluation, exactly
        assert len(launches(folder)) == 1
        study_cmds[name] = [python(), "recipes/cls.py", *FIXED, "--learning_rate", str(t["config"]["learning_rate"]),
                            "--seed", str(t["seed"]), "--output_dir", str(folder), "--resume_from_checkpoint", "auto"]
    # By hand: one trial's command (as written above, not read from the sweep) in another folder, the same metric
    # to the last bit (fp32, same code path, same machine).
    name = "learning_rate=0.003,seed=43"
    hand = tmp_path / "hand"
    cmd = [*study_cmds[name][:-4], "--output_dir", str(hand), "--resume_from_checkpoint", "auto"]
    ran = run_in_own_group(cmd, 300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert read_jsonl(hand / "eval.jsonl")[-1]["loss"] == trials[name]["value"]
    # Every recorded command is the hand-built one (so each of the others is the command its metric came from).
    by_config = {json.dumps(c["config"]): c for c in rep["configurations"]}
    assert len(by_config) == 2
    best = rep["configurations"][0]
    assert rep["best"]["command"] == study_cmds[f"learning_rate={best['config']['learning_rate']},seed=42"]
    # Mean, sample deviation and the 95% Student's t interval (t_0.975 with 1 degree of freedom = 12.7062047362),
    # recomputed here from the trials' values.
    for conf in rep["configurations"]:
        rate = conf["config"]["learning_rate"]
        a, b = (trials[f"learning_rate={rate},seed={s}"]["value"] for s in (42, 43))
        mean, std = (a + b) / 2, abs(a - b) / math.sqrt(2)
        half = 12.7062047362 * std / math.sqrt(2)
        assert conf["n"] == 2 and conf["mean"] == pytest.approx(mean, rel=1e-12)
        assert conf["std"] == pytest.approx(std, rel=1e-9)
        assert conf["ci95"] == pytest.approx([mean - half, mean + half], rel=1e-8)
    assert best["mean"] <= rep["configurations"][1]["mean"]  # loss: lower is better
    other = rep["configurations"][1]
    diffs = [best["values"][s] - other["values"][s] for s in ("42", "43")]
    pd = other["paired_difference"]
    assert pd["seeds"] == [42, 43] and pd["mean"] == pytest.approx(sum(diffs) / 2, rel=1e-12)
    assert pd["std"] == pytest.approx(abs(diffs[0] - diffs[1]) / math.sqrt(2), rel=1e-9)
    md = (out / "report.md").read_text()
    assert "Student's t" in md and f"{best['mean']:.4f}" in md and (out / "report.png").stat().st_size > 1000
    overhead = float(re.search(r"runner overhead ([\d.]+) s per trial", proc.stdout).group(1))
    print(f"runner overhead {overhead:.2f} s per trial")
    assert overhead <= 5.0
    # The report from the storage alone: only study.db, in another folder.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(out / "study.db", alone / "study.db")
    rebuilt = run_in_own_group([python(), "scripts/sweep.py", "--report", "--output_dir", str(alone),
                                "--storage", f"sqlite:///{alone / 'study.db'}"], 120)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert report(alone) == rep


def test_killed_sweep_resumes_to_the_same_report(reference, space, tmp_path):
    ref_out, _ = reference
    out = tmp_path / "killed"
    for folder in (ref_out / "trials").iterdir():  # finished trials: the restart must take them from their files
        if folder.name != FIRST:
            shutil.copytree(folder, out / "trials" / folder.name)
    # The real interpreter: a forked sweep's SIGKILL would take its trial with it (the prewarm server kills what a
    # dead shim started), and the restart's own stop of the orphaned trial is what this test is about.
    cmd = sweep_cmd(out, space, interpreter=PYTHON)
    killed = out / "trials" / FIRST
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not (killed / "checkpoints" / "latest").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "killed.log").read_text()
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # the sweep only: its trial runs in a process group of its own
        proc.wait()
    assert not (killed / "final").exists(), "the trial ended before the kill: nothing was interrupted"
    pgid = json.loads((killed / sweep.LOCK).read_text())["pgid"]
    again = run_sweep(cmd)
    print(again.stdout)
    with pytest.raises(ProcessLookupError):  # no process of the killed sweep's trial is left
        os.killpg(pgid, 0)
    first, second = launches(killed)  # launched twice; the three copied trials never
    assert all(len(launches(out / "trials" / f.name)) == 1 for f in (ref_out / "trials").iterdir() if f.name != FIRST)
    assert "resumed from" not in first
    step = int(re.search(r"resumed from \S+ at step (\d+)", second).group(1))
    print(f"killed trial resumed at step {step}")
    assert 2 <= step < 8  # its first logged step after the restart is step + 1 > 1
    assert [r["step"] for r in read_jsonl(killed / "metrics.jsonl")] == list(range(1, 9))
    got, ref = report(out), report(ref_out)
    assert [(c["config"], c["values"], c["mean"], c["std"], c["ci95"]) for c in got["configurations"]] == \
        [(c["config"], c["values"], c["mean"], c["std"], c["ci95"]) for c in ref["configurations"]]
    assert sorted((t["name"], t["state"], t["value"]) for t in got["trials"]) == \
        sorted((t["name"], t["state"], t["value"]) for t in ref["trials"])
    best, ref_best = got["best"]["command"], ref["best"]["command"]  # each begins with the interpreter its sweep ran
    assert best[0] == PYTHON and ref_best[0] == python()
    assert json.dumps(best[1:]).replace(str(out), str(ref_out)) == json.dumps(ref_best[1:])


def test_pruned_and_failed_trials_are_recorded(reference, tmp_path):
    """The reference's study extended by two rates on seed 42: 1.0 (its step-3 evaluation loss is far above the
    median of the four finished trials' step-3 losses, so the median pruner stops it) and -1 (refused by the
    recipe's flag check)."""
    ref_out, _ = reference
    out = tmp_path / "extended"
    shutil.copytree(ref_out, out)
    space = tmp_path / "space.yaml"
    space.write_text("learning_rate: [1e-3, 3e-3, 1.0, -1]\n")
    # The tiny model's steps take milliseconds: without a pause the trial could reach step 8 before the sweep's
    # SIGTERM (it stopped at step 7 in two runs). The probe's `wait` fault holds the trial after step 3's evaluation
    # until a stop signal arrives (60 s at most), so the pruner's SIGTERM always lands there, and the recipe stops at
    # the next step's flush and checkpoints step 4 (as tests/test_long_runs.py's signalled run stops at 8 after 7).
    proc = run_sweep(sweep_cmd(out, space, 1, "--prune"), env={"CLS_FAULT": "wait:3:0"})
    rep = report(out)
    states = {t["name"]: t for t in rep["trials"]}
    assert len(states) == 6 and sum(t["state"] == "COMPLETE" for t in states.values()) == 4
    pruned, failed = states["learning_rate=1.0,seed=42"], states["learning_rate=-1,seed=42"]
    assert failed["state"] == "FAIL" and failed["error"] == "error: --learning_rate -1.0 must be > 0"
    folder = out / "trials" / pruned["name"]
    # Optuna 5.0.0 stores a pruned trial's last reported intermediate value as its value; the report leaves it out.
    assert pruned["state"] == "PRUNED" and pruned["value"] == read_jsonl(folder / "eval.jsonl")[-1]["loss"], proc.stdout
    assert [c["config"]["learning_rate"] for c in rep["configurations"]] == [0.001, 0.003]
    marker = (folder / "checkpoints" / "PREEMPTED").read_text().strip()
    assert pruned["pruned_at"] == marker
    step = int(marker.removeprefix("step_"))
    assert step == 4 and (folder / "checkpoints" / marker / "trainer_state.json").is_file()
    assert not (folder / "final").exists()
    first_eval = read_jsonl(folder / "eval.jsonl")[0]
    median = sorted(read_jsonl(ref_out / "trials" / t / "eval.jsonl")[0]["loss"]
                    for t in os.listdir(ref_out / "trials"))
    print(f"pruned at {marker}: step-3 loss {first_eval['loss']:.4f} vs the others' {median}")
    assert first_eval["step"] == 3 and first_eval["loss"] > max(median)
    assert len(launches(out / "trials" / failed["name"])) == 1
    md = (out / "report.md").read_text()
    assert "PRUNED" in md and "error: --learning_rate -1.0 must be > 0" in md


def test_restarted_tpe_sweep_first_completes_the_seeds_of_its_configurations():
    """No launch: the planner on an in-memory study. A TPE sweep of 3 seeds per configuration stopped after 2 seeds
    of its first configuration gives that configuration's third seed first when it starts again, then a new
    configuration with all 3 seeds (before the fix it sampled a new configuration and left the first at n = 2)."""
    import argparse

    import optuna

    space = {"learning_rate": {"low": 1e-4, "high": 1e-2, "log": True}}
    args = argparse.Namespace(seeds=3, trials=6)
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
    first = sweep.plan(args, study, space)
    done = []
    for _ in range(2):
        trial, config, seed = next(first)
        study.tell(trial.number, 0.5)
        done.append((config, seed))
    first.close()  # the sweep stops here (killed between two trials)
    assert [seed for _, seed in done] == [42, 43] and done[0][0] == done[1][0]
    again = list(sweep.plan(args, study, space))
    assert [(config, seed) for _, config, seed in again[:1]] == [(done[0][0], 44)]
    assert again[0][0].params == done[0][0]  # the trial's own parameters are that configuration too
    assert [seed for _, _, seed in again[1:]] == [42, 43, 44] and len({str(c) for _, c, _ in again[1:]}) == 1
    assert again[1][1] != done[0][0] and len(again) == 4  # the budget: 6 trials in all


def test_a_changed_space_is_refused_before_the_storage_changes(tmp_path, capsys):
    """No launch: a sweep's study opened again with another space. Grid values added extend it; a range's log,
    low or high changed, a grid value removed, a flag added, or another range type stop it in one line, the storage
    byte for byte as it was (a log change used to end in Optuna's traceback after the new setup was written)."""
    import argparse

    def args(**extra):
        return argparse.Namespace(output_dir=str(tmp_path), storage=None, prune=False, report=False, metric="accuracy",
                                  seeds=2, fixed=[], config_file=None, num_processes=None, **extra)

    ranged = {"learning_rate": {"low": 1e-4, "high": 1e-2, "log": True}, "warmup_steps": [0, 2]}
    sweep.open_study(args(), ranged)
    db = tmp_path / "study.db"
    before = db.read_bytes()
    for changed, said in (({"log": False}, 'learning_rate {"low": 0.0001, "high": 0.01, "log": true} -> '),
                          ({"low": 1e-3}, "learning_rate"), ({"high": 1e-3}, "learning_rate")):
        other = {**ranged, "learning_rate": {**ranged["learning_rate"], **changed}}
        with pytest.raises(SystemExit) as stop:
            sweep.open_study(args(), other)
        assert stop.value.code == 2 and db.read_bytes() == before
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: ") and said in line and "another --output_dir" in line
    for other, said in (({**ranged, "warmup_steps": [0]}, "warmup_steps values [2] removed"),
                        ({**ranged, "weight_decay": [0.0]}, "weight_decay added"),
                        ({**ranged, "learning_rate": [1e-3]}, "learning_rate {")):
        with pytest.raises(SystemExit):
            sweep.open_study(args(), other)
        assert said in capsys.readouterr().err and db.read_bytes() == before
    study = sweep.open_study(args(), {**ranged, "warmup_steps": [0, 2, 4]})  # a grid value added: the same sweep
    assert study.user_attrs["setup"]["space"]["warmup_steps"] == [0, 2, 4]


def test_intervals_of_a_bounded_metric_stay_in_its_range():
    """Two seeds at 0.99 and 0.67: the t interval (0.4488-1.2112 unbounded) is cut to accuracy's [0, 1] and says so;
    a loss is not cut; a paired difference is a plain summary (no bounds), negative values and all."""
    values = [0.99, 0.67]
    plain = sweep.summary(values)
    assert plain["ci95"] == pytest.approx([0.8300 - 2.0331, 0.8300 + 2.0331], abs=1e-3)
    cut = sweep.summary(values, sweep.metric_bounds("accuracy"))
    assert cut["ci95"] == pytest.approx([0.0, 1.0]) and cut["ci95_clipped"] is True
    assert sweep.summary([0.80, 0.82, 0.81], sweep.metric_bounds("mismatched_f1_macro"))["ci95_clipped"] is False
    assert sweep.metric_bounds("loss") is None and sweep.metric_bounds("matthews_correlation") == (-1.0, 1.0)
    assert sweep.summary([-0.5, 0.1])["ci95"][0] < -1  # a difference: never cut
