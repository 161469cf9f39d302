"""Long runs (recipes/checkpoints/preemption.py, best_model.py): one command for the first start and every restart, preemption, rotation,
the best model, early stopping and the non-finite guard, checked against one uninterrupted reference run.

Every launch here uses the same restartable command (REF_FLAGS, --resume_from_checkpoint auto): 2 processes x 8
samples, evaluation every 3 steps, a checkpoint every 2 steps, the newest 2 kept. With these data the accuracy is best
at step 3 and no better at steps 6 and 9, so --early_stopping_patience 2 ends the reference at step 9: every
interrupted run below must end exactly there too, with the same losses, evaluations, best step and best/ weights.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import (PYTHON, REPO, TINY_FLAGS, eval_loader, free_port, kill_group, launcher, losses, rank_records,
                     read_jsonl, run_recipe)
from recipes import RecipeError
from recipes.checkpoints import best_model, checkpoint, preemption
from recipes.checkpoints.checkpoint import ResumePoint

REF_FLAGS = ["--per_device_train_batch_size", "8", "--max_train_steps", "12", "--eval_steps", "3",
             "--checkpointing_steps", "2", "--save_total_limit", "2", "--logging_steps", "2",
             "--early_stopping_patience", "2", "--load_best_model_at_end", "--resume_from_checkpoint", "auto",
             "--record_ranks"]
STOP_STEP, BEST_STEP = 9, 3


def restart_env() -> dict:
    """The launch line under which torch's elastic agent can restart the workers (README "Long runs"): a c10d
    rendezvous, and a fresh TCP store per attempt (torch 2.13.0 shares the agent's store with the workers by default,
    and a restarted worker group then fails to connect). The endpoint on a free port: c10d's default, 29400, would be
    shared with any other c10d launch on this machine (a README command run by test_strength)."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_RDZV_ENDPOINT": f"localhost:{free_port()}"}


def restart_args() -> list[str]:
    return ["--max_restarts", "1", "--rdzv_backend", "c10d"]


pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("long_ref")
    proc = run_recipe(out, *REF_FLAGS)
    assert "--resume_from_checkpoint auto: no checkpoint in" in proc.stdout + proc.stderr
    return out


def eval_records(out: Path) -> list[dict]:
    return read_jsonl(out / "eval.jsonl")


def assert_same_run(ref: Path, got: Path) -> None:
    """Losses, evaluations (with the best-so-far and patience), best/ and final/ weights equal the reference's."""
    assert losses(got) == losses(ref) and len(losses(ref)) == STOP_STEP
    assert eval_records(got) == eval_records(ref)
    for folder in ("best", "final"):
        assert (got / folder / "model.safetensors").read_bytes() == (ref / folder / "model.safetensors").read_bytes()
    assert json.loads((got / "best" / "best_model.json").read_text())["step"] == BEST_STEP


def checkpoint_steps(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir() if p.is_dir() and p.name[5:].isdigit())


def test_reference_keeps_the_best_stops_early_and_rotates(reference, tmp_path):
    evals = eval_records(reference)
    assert [e["step"] for e in evals] == [3, 6, 9]
    assert set(best_model.EVAL_METRICS["single_label"]) <= set(evals[0])  # every accepted name is reported
    assert [e["evals_without_improvement"] for e in evals] == [0, 1, 2]
    assert {e["best_step"] for e in evals} == {BEST_STEP} and {e["best_metric"] for e in evals} == {"accuracy"}
    assert evals[0]["accuracy"] >= max(e["accuracy"] for e in evals)
    assert len(losses(reference)) == STOP_STEP  # 12 steps planned, stopped after 2 evaluations without improvement
    # The newest 2 checkpoints; the early stop wrote one of its step, so that a restart knows the run ended.
    assert checkpoint_steps(reference) == [8, STOP_STEP]
    assert (reference / "checkpoints" / "latest").read_text().strip() == f"step_{STOP_STEP}"
    state = json.loads((reference / "checkpoints" / f"step_{STOP_STEP}" / "trainer_state.json").read_text())
    assert state["long_run"] == {"metric": "accuracy", "best_value": evals[0]["accuracy"], "best_step": BEST_STEP,
                                 "evals_without_improvement": 2}
    resolved = json.loads((reference / "run_config.json").read_text())["long_run"]
    assert resolved["metric_for_best_model"] == "accuracy" and resolved["greater_is_better"] is True
    # --load_best_model_at_end: final/ is best/, whose weights give the best evaluation again in one process.
    best = reference / "best"
    assert (reference / "final" / "model.safetensors").read_bytes() == (best / "model.safetensors").read_bytes()
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from recipes import cls
    from recipes.metrics import load_metrics

    cfg = cls.parse_config(["--model_name_or_path", str(best), *TINY_FLAGS[2:]])
    eval_dl, _ = eval_loader(cfg, AutoTokenizer.from_pretrained(best))
    again = cls.evaluate(AutoModelForSequenceClassification.from_pretrained(best), eval_dl, Accelerator(cpu=True),
                         load_metrics())
    assert again["accuracy"] == evals[0]["accuracy"] and again["n_examples"] == 101
    # The same command once more: it resumes from the early stop's checkpoint and trains nothing.
    rerun = tmp_path / "rerun"
    (rerun / "checkpoints").mkdir(parents=True)
    for name in ("metrics.jsonl", "eval.jsonl"):
        (rerun / name).write_bytes((reference / name).read_bytes())
    shutil.copytree(reference / "checkpoints" / f"step_{STOP_STEP}", rerun / "checkpoints" / f"step_{STOP_STEP}")
    shutil.copytree(best, rerun / "best")
    (rerun / "checkpoints" / "latest").write_text(f"step_{STOP_STEP}\n")
    proc = run_recipe(rerun, *REF_FLAGS)
    assert f"resumed from {rerun / 'checkpoints' / f'step_{STOP_STEP}'} at step {STOP_STEP}" in proc.stdout
    assert losses(rerun) == losses(reference) and eval_records(rerun) == eval_records(reference)


def test_elastic_restart_continues_from_the_newest_checkpoint(reference, tmp_path):
    """Rank 1 is SIGKILLed while saving step_4, after the evaluation of step 3 wrote best/: the elastic agent restarts
    both workers with the same command, which resumes from step_2 (the newest complete checkpoint; step_4.tmp is
    half-written) through `accelerator.skip_first_batches`, evaluates step 3 again and ends as the reference does."""
    out = tmp_path / "restarted"
    proc = run_recipe(out, *REF_FLAGS, launch_args=restart_args(), env={**restart_env(), "CLS_FAULT": "save:4:1"})
    text = proc.stdout + proc.stderr
    assert "warning:" not in text  # the launch line the launch checks ask for
    assert "no checkpoint in" in text and f"resumed from {out / 'checkpoints' / 'step_2'} at step 2" in text
    assert_same_run(reference, out)
    for ref_rank, rank in zip(rank_records(reference), rank_records(out)):
        assert rank["sample_ids"] == ref_rank["sample_ids"][2:]  # 2 micro-batches per rank before the checkpoint
        assert rank["epochs"][0] == {"epoch": 0, "batch_sampler": "SkipBatchSampler", "skipped_batches": 2}


def stopped(out: Path, proc: subprocess.CompletedProcess, **facts) -> SimpleNamespace:
    """What a preempted launch left, read when it ended (the next launch in the folder changes it): its output, the
    marker, the marked checkpoint's trainer_state.json and the steps of the records."""
    marker = out / "checkpoints" / checkpoint.PREEMPTED_MARKER
    marked = marker.read_text().strip() if marker.exists() else None
    state = json.loads((out / "checkpoints" / marked / "trainer_state.json").read_text()) if marked else None
    return SimpleNamespace(proc=proc, marker=marked, state=state, eval_steps=[e["step"] for e in eval_records(out)],
                           metric_steps=[r["step"] for r in read_jsonl(out / "metrics.jsonl")], **facts)


def signal_the_launcher(out: Path) -> tuple[subprocess.CompletedProcess, float]:
    """The same command under `accelerate launch`, SIGTERMed while rank 0 waits after step 7; the seconds the
    launcher took to exit after it."""
    cmd = [*launcher(), "launch", "--config_file", "accelerate_configs/ddp.yaml", "--main_process_port",
           str(free_port()), "recipes/cls.py", *TINY_FLAGS, "--output_dir", str(out), *REF_FLAGS]
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "CLS_FAULT": "wait:7:0"}, start_new_session=True) as proc:
        try:
            deadline = time.monotonic() + 300
            while not (out / "probe_waiting").exists():
                assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 7"
                time.sleep(0.2)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=120)
            took = time.monotonic() - signalled
        except BaseException:
            kill_group(proc)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), took


@pytest.fixture(scope="module")
def preempted_twice(tiny_model, tmp_path_factory):
    """One folder, three launches of the same command: SIGTERM to rank 1 after step 5 (the run stops at step 6);
    the resume, SIGTERMed through the launcher after step 7 (it stops at step 8); the resume of that, to the end.
    The two preemption tests read it: the second launch is the first one's resume and the second one's fault."""
    out = tmp_path_factory.mktemp("preempted") / "run"
    worker = stopped(out, run_recipe(out, *REF_FLAGS, check=False, env={"CLS_FAULT": "sigterm:5:1"}))
    proc, took = signal_the_launcher(out)
    launcher = stopped(out, proc, took=took)
    run_recipe(out, *REF_FLAGS)
    return SimpleNamespace(out=out, worker=worker, launcher=launcher)


def test_preempted_worker_stops_every_rank_at_a_checkpoint_then_resumes(reference, preempted_twice):
    """SIGTERM reaches rank 1 only, after step 5: the ranks agree at the next flush (step 6, --logging_steps 2),
    save step_6, mark it and exit with the preemption status; the same command then finishes the reference's run,
    the evaluation due at step 6 included (its first resume, stopped at step 8, is the launcher test's)."""
    first, out = preempted_twice.worker, preempted_twice.out
    assert first.proc.returncode != 0
    assert "preempted (a stop signal on 1 of 2 ranks): checkpoint step_6 written" in first.proc.stdout
    assert "exitcode  : 3" in first.proc.stderr
    assert first.marker == "step_6"
    assert first.state["step"] == 6 and first.state["eval_pending"] is True
    assert first.eval_steps == [3]  # the evaluation of step 6 is left to the resumed run
    assert not (out / "checkpoints" / checkpoint.PREEMPTED_MARKER).exists()
    assert_same_run(reference, out)


def test_signal_before_training_stops_at_the_first_flush(reference, tmp_path):
    """SIGUSR1 reaches rank 1 at start-up, before its data are prepared: the handler is already installed, so the
    rank does not die; every rank stops at the first flush (step 2), checkpoints it and exits with status 3."""
    out = tmp_path / "early_signal"
    proc = run_recipe(out, *REF_FLAGS, check=False, env={"CLS_FAULT": "sigusr1:0:1"})
    assert "preempted (a stop signal on 1 of 2 ranks): checkpoint step_2 written" in proc.stdout, proc.stderr[-3000:]
    assert "exitcode  : 3" in proc.stderr
    assert (out / "checkpoints" / checkpoint.PREEMPTED_MARKER).read_text().strip() == "step_2"
    assert checkpoint_steps(out) == [2] and [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    # Its resume is the other preemption tests' (and test_elastic_restart's from step_2): not launched again here.


def test_sigterm_to_the_launcher_checkpoints_within_the_kill_window(reference, preempted_twice):
    """SIGTERM to `accelerate launch` while rank 0 waits after step 7 (a run resumed from the preempted step_6): the
    agent forwards it to both workers, which stop at the flush of step 8, checkpoint it and exit before the agent's
    SIGKILL; the same command resumes."""
    second, out = preempted_twice.launcher, preempted_twice.out
    stdout, stderr = second.proc.stdout, second.proc.stderr
    print(f"launcher exited {second.proc.returncode} {second.took:.1f} s after SIGTERM")
    assert second.took < 30, "the workers must be done before the agent's SIGKILL (30 s after it forwards SIGTERM)"
    assert second.marker == "step_8", stdout + stderr
    assert "preempted (a stop signal on 2 of 2 ranks): checkpoint step_8 written" in stdout  # forwarded to both
    assert second.state["step"] == 8
    assert second.metric_steps == list(range(1, 9))
    assert_same_run(reference, out)


def test_non_finite_loss_stops_before_any_later_checkpoint(reference, tmp_path):
    out = tmp_path / "nan"
    proc = run_recipe(out, *REF_FLAGS, check=False, env={"CLS_FAULT": "nan:5:1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "non-finite loss nan at step 5" in errors[0]
    assert f"last good checkpoint: {out / 'checkpoints' / 'step_4'}" in errors[0]
    assert checkpoint_steps(out) == [2, 4] and (out / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert losses(out)[:4] == losses(reference)[:4] and math.isnan(losses(out)[4])
    assert not (out / "final").exists()


def test_failed_save_on_one_rank_stops_every_rank_and_resume_goes_on(reference, tmp_path):
    out = tmp_path / "disk_full"
    started = time.monotonic()
    proc = run_recipe(out, *REF_FLAGS, check=False, env={"CLS_FAULT": "savefail:4:1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and time.monotonic() - started < 90
    assert len(errors) == 1 and "saving checkpoint step_4 failed on rank(s) 1" in errors[0], proc.stderr[-3000:]
    assert "No space left on device" in errors[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_2" and checkpoint_steps(out) == [2]
    # The same command resumes from step_2 past a half-written step_4: test_elastic_restart launches exactly that.
    assert (out / "checkpoints" / "step_4.tmp").is_dir()


# --- no launches ----------------------------------------------------------------------------------------------------
class Cfg:
    problem_type = "single_label"
    task_name = None
    metric_for_best_model = None
    early_stopping_patience = 2
    save_total_limit = None


def make_run(tmp_path, **overrides) -> best_model.BestModel:
    cfg = Cfg()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return best_model.BestModel(cfg, ResumePoint())


def test_best_metric_direction_nan_and_patience(tmp_path):
    run = make_run(tmp_path, metric_for_best_model="loss")
    assert run.greater_is_better is False
    seq = [(1, 0.9), (2, float("nan")), (3, 0.5), (4, 0.7), (5, 0.6)]
    better = [run.after_eval({"step": s, "loss": v}) for s, v in seq]
    assert better == [True, False, True, False, False]  # a NaN is never the best
    assert (run.best_step, run.best_value, run.bad_evals, run.stop_early) == (3, 0.5, 2, True)
    resumed = best_model.BestModel(Cfg(), ResumePoint(long_run=run.state()))
    assert (resumed.best_step, resumed.bad_evals, resumed.stop_early) == (3, 2, True)
    with pytest.raises(RecipeError, match="reports accuracy, f1_macro, f1, matthews_correlation, loss"):
        make_run(tmp_path, metric_for_best_model="pearson")
    assert make_run(tmp_path).metric == "accuracy" and make_run(tmp_path).greater_is_better
    for problem_type, default in (("regression", "pearson"), ("multi_label", "micro_f1")):
        assert make_run(tmp_path, problem_type=problem_type).metric == default
    # a named task's own metric: MRPC by F1; SST-2 names none, so accuracy
    assert [make_run(tmp_path, task_name=name).metric for name in ("mrpc", "sst2")] == ["f1", "accuracy"]
    assert make_run(tmp_path, task_name="mrpc", metric_for_best_model="loss").metric == "loss"


def test_stop_signals_are_caught_and_blocks_checked(tmp_path):
    before = {sig: signal.getsignal(sig) for sig in preemption.STOP_SIGNALS}
    try:
        preemption.install_signal_handlers()
        assert {sig: signal.getsignal(sig) for sig in before} == {sig: preemption._on_signal for sig in before}
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested_signal == signal.SIGUSR1 and preemption.StepGuard.stop_vote() == 1.0
    finally:
        preemption.requested_signal = None
        for sig, handler in before.items():
            signal.signal(sig, handler)
    run = preemption.StepGuard(ResumePoint(), tmp_path)
    assert run.stop_vote() == 0.0
    rec = {"step": 7, "loss": 0.5, "skipped_steps": 0}
    run.check_block([(rec, 0, 0)])
    assert not run.preempted
    run.check_block([({**rec, "step": 8}, 0, 1)])
    assert run.preempted
    # an fp16 overflow step (skipped_steps grew) with an infinite loss is no failure ...
    run.check_block([({"step": 9, "loss": float("inf"), "skipped_steps": 1}, 1, 0)])
    # ... an unskipped one is, and so is a non-finite gradient norm with a finite loss
    run.saved(tmp_path / "checkpoints" / "step_8")
    with pytest.raises(RecipeError, match=r"non-finite loss inf at step 10: .* last good checkpoint: .*step_8"):
        run.check_block([({"step": 10, "loss": float("inf"), "skipped_steps": 1}, 0, 0)])
    with pytest.raises(RecipeError, match="non-finite gradient norm at step 11"):
        run.check_block([({"step": 11, "loss": 0.4, "skipped_steps": 1}, 2, 0)])


def test_rotation_keeps_the_newest_and_latest_and_their_conversions(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_2", "step_4", "step_4.universal", "step_10", "step_12", "step_14.tmp"):
        (root / name).mkdir(parents=True)
        if "." not in name:  # complete: every rank saved (checkpoint.save_checkpoint writes it last)
            (root / name / "trainer_state.json").write_text("{}")
    (root / "latest").write_text("step_4\n")  # e.g. a run resumed from step_4 after a rollback
    assert checkpoint.rotate_checkpoints(root, 2) == ["step_2"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_10", "step_12", "step_14.tmp", "step_4",
                                                      "step_4.universal"]
    (root / "latest").write_text("step_12\n")
    assert checkpoint.rotate_checkpoints(root, 1) == ["step_4", "step_10"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_12", "step_14.tmp"]
    assert checkpoint.rotate_checkpoints(root, None) == []


@pytest.mark.parametrize("flags,message", [
    (["--save_total_limit", "0"], "--save_total_limit 0 must be >= 1"),
    (["--early_stopping_patience", "-1"], "--early_stopping_patience -1 must be >= 1"),
    (["--load_best_model_at_end", "--do_predict"], "--load_best_model_at_end with predictions"),
    (["--metric_for_best_model", "acc"], "--metric_for_best_model acc: known metrics: accuracy, exact_match, f1"),
    (["--metric_for_best_model", ""], "--metric_for_best_model : known metrics"),
    (["--problem_type", "regression", "--metric_for_best_model", "accuracy"],
     "--metric_for_best_model accuracy: the evaluation of a regression problem reports pearson, spearman, loss"),
    (["--task_name", "stsb", "--metric_for_best_model", "f1"], "a regression problem reports"),
    (["--resume_from_checkpoint", "newest"], "--resume_from_checkpoint newest: not a folder"),
])
def test_bad_long_run_flags_fail_in_one_line(flags, message):
    from recipes import cls

    with pytest.raises(RecipeError, match=message):
        cls.parse_config(["--model_name_or_path", "x", *flags])


def test_restart_warnings_follow_torchs_store_sharing(monkeypatch):
    """The launch check warns when torch's agent would restart workers into its own store (static rendezvous, or c10d
    without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): the env value is taken from torch 2.13.0's rendezvous classes."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from recipes.checks.launch_checks import restart_warnings

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    shared = {"static": StaticTCPRendezvous.use_agent_store.fget(None),
              "c10d": DynamicRendezvousHandler.use_agent_store.fget(None)}
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    shared["c10d, fresh store"] = DynamicRendezvousHandler.use_agent_store.fget(None)
    assert shared == {"static": True, "c10d": True, "c10d, fresh store": False}
    good = {"resume_from_checkpoint": "auto", "checkpointing_steps": "50"}
    for launch, agent_store in shared.items():
        env = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": str(agent_store)}
        warnings = restart_warnings(env, good)
        assert len(warnings) == int(agent_store), launch
        assert all("--rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in w for w in warnings)
        assert restart_warnings({**env, "TORCHELASTIC_MAX_RESTARTS": "0"}, {}) == []  # no restarts: nothing to say
    fresh = {"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert [w.split(":")[0] for w in restart_warnings(fresh, {"resume_from_checkpoint": "latest"})] == [
        "--max_restarts without --resume_from_checkpoint auto", "--max_restarts without --checkpointing_steps"]


def test_slurm_script_turns_usr1_into_a_checkpoint_and_requeues(tmp_path):
    """scripts/slurm_multinode.sh under stub srun/scontrol/accelerate: the launch gets --resume_from_checkpoint auto,
    a fresh rendezvous store per attempt and the kill window; SLURM's USR1 reaches the launch as SIGTERM; the launch
    leaves the preemption marker and the script requeues the job. A launch that fails without a marker (a stale one
    is removed first) is not requeued and its status is the script's."""
    bin_dir, calls, submit, ready = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "submit", tmp_path / "ready"
    bin_dir.mkdir()
    submit.mkdir()
    for name in ("scripts", "recipes", "accelerate_configs", "ds_configs", "artifacts"):
        (submit / name).symlink_to(REPO / name)
    out = submit / "runs" / "long"
    stubs = {
        "scontrol": 'if [[ $1 == show ]]; then echo node-1; else echo "scontrol $*" >> "$CALLS"; fi',
        "srun": 'echo "srun $*" >> "$CALLS"; while [[ "$1" == --* ]]; do shift; done; SLURM_NODEID=0 exec "$@"',
        "accelerate": 'echo "accelerate $* store=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE'
                      ' window=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" >> "$CALLS"\n'
                      'if [[ $MODE == fail ]]; then exit 1; fi\n'
                      'trap \'echo "launch got TERM" >> "$CALLS"; mkdir -p "$OUT/checkpoints"; '
                      'echo step_6 > "$OUT/checkpoints/PREEMPTED"; exit 1\' TERM\n'
                      'touch "$READY"; while true; do sleep 0.1; done',
        "python": f'exec {PYTHON} "$@"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "node-1", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "2", "OUT": str(out),
           "SLURM_SUBMIT_DIR": str(submit), "READY": str(ready), "MODE": "preempt"}
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    script = REPO / "scripts" / "slurm_multinode.sh"
    flags = ["--model_name_or_path", str(TINY_FLAGS[1]), "--output_dir", "runs/long", "--checkpointing_steps", "50"]
    with subprocess.Popen(["bash", str(script), *flags], cwd=submit, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout + stderr
    lines = calls.read_text().splitlines()
    launch = next(line for line in lines if line.startswith("accelerate launch"))
    assert launch.endswith("--resume_from_checkpoint auto store=1 window=150")
    assert lines[-2:] == ["launch got TERM", "scontrol requeue 4242"]
    assert "preempted at step_6: requeueing job 4242" in stdout
    lead = next(line for line in script.read_text().splitlines() if line.startswith("SLURM_SIGNAL_LEAD="))
    lead = int(lead.split("=")[1])
    assert f"#SBATCH --signal=B:USR1@{lead} " in script.read_text() and "#SBATCH --requeue" in script.read_text()
    # A failed launch with a stale marker from an earlier run: removed first, no requeue, the launch's status.
    calls.unlink()
    proc = subprocess.run(["bash", str(script), *flags, "--resume_from_checkpoint", "latest"], cwd=submit,
                          env={**env, "MODE": "fail"}, capture_output=True, text=True, timeout=120)
    lines = calls.read_text().splitlines()
    assert proc.returncode == 1 and not any(line.startswith("scontrol") for line in lines)
    assert not (out / "checkpoints" / checkpoint.PREEMPTED_MARKER).exists()
    assert lines[-1].count("--resume_from_checkpoint") == 1  # the user's value is kept, no auto added
