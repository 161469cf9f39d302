"""Long runs: preemption, the best model, early stopping and the non-finite-loss guard (`--resume_from_checkpoint
auto` and checkpoint rotation are in checkpoint.py). cls.py makes one `LongRun` and calls it at the loop's boundaries.

How the ranks agree without a host read per step: each optimizer step already all-reduces a small tensor of the
step's loss sums (records.StepLog); two more entries ride on it, this rank's preemption vote and whether its gradient
norm was finite. The host reads that tensor only at a flush (every --logging_steps steps, and before every
evaluation, checkpoint and the end), where every rank sees the same reduced values and so takes the same decision:
- preemption: a SIGTERM or SIGUSR1 on any rank stops every rank at the flush that follows (at most --logging_steps
  optimizer steps later), which then writes a checkpoint of that step, the marker checkpoints/PREEMPTED, and exits
  with PREEMPTED_EXIT;
- a non-finite loss, or gradient norm, of a step that was not skipped on purpose (fp16 overflow steps are) stops
  every rank with one error line. Every checkpoint, evaluation and final/ comes after a flush, so none is ever
  written from weights that came after it.
"""
from __future__ import annotations

import json
import math
import os
import signal
import threading
from pathlib import Path
from typing import Optional

from recipes import RecipeError
from recipes.checkpoints import checkpoint
from recipes.inputs import tasks
from recipes.metrics import AVAILABLE, SCORES
from recipes.outputs import records

PREEMPTED_EXIT = 3  # exit status of a worker that stopped on a signal after writing its checkpoint: resume it
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The metrics eval.jsonl reports per problem type: the scores and the evaluation's mean loss (cls.evaluate); the
# first one is the default --metric_for_best_model.
EVAL_METRICS = {problem_type: (*scores, "loss") for problem_type, scores in SCORES.items()}
# What --metric_for_best_model accepts: those, and the scores a task or --metric_name adds (a run asked to keep the
# best model by one of these reports it: tasks.extra_scores).
ACCEPTED = {problem_type: (*scores, "loss") for problem_type, scores in AVAILABLE.items()}

requested_signal: Optional[int] = None  # the stop signal this process received (module-wide: see probe.py's wait)


class Preempted(Exception):
    """Every rank stopped on a signal, after checkpoint `name`: the process exits with PREEMPTED_EXIT."""


def _on_signal(signum, frame) -> None:  # only a flag: the loop stops at the next flush, where the ranks agree
    global requested_signal
    requested_signal = signum


def install_signal_handlers() -> None:
    """SIGTERM (what SLURM, Kubernetes and torch's elastic agent send before a SIGKILL) and SIGUSR1 (SLURM's
    --signal=USR1@<seconds>, when it reaches the workers directly) ask for a checkpoint and a stop. Installed first
    thing in main, so that a signal during the data preparation is not the default's instant death; only Python's
    main thread may install handlers (an in-process harness running main in a thread keeps its own)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _on_signal)


def metric_problem(metric: str, problem_type: Optional[str]) -> Optional[str]:
    """Why `metric` cannot pick the best model of a `problem_type` run (None: inferred later from the data)."""
    known = ACCEPTED[problem_type] if problem_type else sorted({m for ms in ACCEPTED.values() for m in ms})
    if metric in known:
        return None
    what = f"the evaluation of a {problem_type} problem reports" if problem_type else "known metrics:"
    return f"--metric_for_best_model {metric}: {what} {', '.join(known)}"


def best_metric(cfg) -> str:
    """The metric that picks best/: --metric_for_best_model, else the task's, else the problem type's first."""
    task_metric = tasks.get_task(cfg.task_name).metric if getattr(cfg, "task_name", None) else None
    return cfg.metric_for_best_model or task_metric or EVAL_METRICS[cfg.problem_type][0]


def metric_direction(metric: str) -> bool:
    """True when higher is better: names ending in `loss` are minimised, the others maximised."""
    return not metric.endswith("loss")


class LongRun:
    """Best model, early stopping, preemption and the non-finite guard for one run (every rank holds the same one)."""

    def __init__(self, cfg, start, out: Path):
        self.metric = best_metric(cfg)
        problem = metric_problem(self.metric, cfg.problem_type)
        if problem:
            raise RecipeError(problem)
        self.greater_is_better = metric_direction(self.metric)
        self.patience, self.keep = cfg.early_stopping_patience, cfg.save_total_limit
        saved = {} if start.best_restarts else start.long_run or {}  # restarted: other evaluations than before
        self.best_value = saved.get("best_value")
        self.best_step = saved.get("best_step")
        self.bad_evals = saved.get("evals_without_improvement", 0)
        self.skipped_before = start.skipped_steps  # fp16 overflow steps counted up to the previous block
        self.last_checkpoint = str(start.path) if start.path else None
        self.preempted = 0  # how many ranks voted to stop, at the flush that saw the first vote; 0: none
        self.out = out

    # --- the per-step votes and the decisions taken at a flush ---------------------------------------------------
    @staticmethod
    def stop_vote() -> float:
        return 1.0 if requested_signal is not None else 0.0

    def check_block(self, block: list) -> None:
        """Called by StepLog.flush with (record, non-finite gradient norms, stop votes) per step, the same on every
        rank: raise on the first non-finite step, note an agreed preemption."""
        for record, bad_grads, votes in block:
            skipped = record["skipped_steps"] > self.skipped_before  # an fp16 overflow step: skipped by design
            self.skipped_before = record["skipped_steps"]
            if not skipped and (not math.isfinite(record["loss"]) or bad_grads):
                what = f"loss {record['loss']}" if not math.isfinite(record["loss"]) else "gradient norm"
                raise RecipeError(f"non-finite {what} at step {record['step']}: the run stopped before any later "
                                  f"checkpoint; last good checkpoint: {self.last_checkpoint or 'none'}")
            if votes and not self.preempted:
                self.preempted = votes

    def saved(self, path: Path) -> None:
        self.last_checkpoint = str(path)

    # --- evaluations: best model and early stopping ----------------------------------------------------------------
    def after_eval(self, record: dict) -> bool:
        """Update the best-so-far and the patience count with an evaluation; True when it is a new best. The same
        on every rank (the metrics come from gathered predictions); adds the state to the eval record."""
        value = record.get(self.metric)
        better = value is not None and math.isfinite(value) and (
            self.best_value is None or (value > self.best_value if self.greater_is_better else value < self.best_value))
        if better:
            self.best_value, self.best_step, self.bad_evals = value, record["step"], 0
        else:
            self.bad_evals += 1
        record.update({"best_metric": self.metric, "best_value": self.best_value, "best_step": self.best_step,
                       "evals_without_improvement": self.bad_evals})
        return better

    @property
    def stop_early(self) -> bool:
        return bool(self.patience) and self.bad_evals >= self.patience

    def state(self) -> dict:
        """What a checkpoint keeps of it (trainer_state.json `long_run`), for a resumed run to go on alike."""
        return {"metric": self.metric, "best_value": self.best_value, "best_step": self.best_step,
                "evals_without_improvement": self.bad_evals}

    def describe(self) -> dict:
        """For run_config.json."""
        return {"metric_for_best_model": self.metric, "greater_is_better": self.greater_is_better,
                "early_stopping_patience": self.patience, "save_total_limit": self.keep,
                "preempted_exit_status": PREEMPTED_EXIT}

    # --- preemption ----------------------------------------------------------------------------------------------
    def leave_preempted(self, accelerator, checkpoint_name: str) -> None:
        if accelerator.is_main_process:
            (self.out / "checkpoints" / checkpoint.PREEMPTED_MARKER).write_text(checkpoint_name + "\n")
        accelerator.print(f"preempted (a stop signal on {self.preempted} of {accelerator.num_processes} ranks): "
                          f"checkpoint {checkpoint_name} written; run the same command with "
                          f"--resume_from_checkpoint auto to go on")
        raise Preempted(checkpoint_name)


def finished_before(start, total_steps: int, out: Path) -> Optional[dict]:
    """A relaunch of a run that already ended: the evaluation final/ holds, and final/ is left as it is; None when
    there is training (or final/) left to do. A run ends at its last step or an early stop, and writes a checkpoint
    there (checkpoint.checkpoint_due). Changes forced onto a run with no step left would train nothing: refused."""
    if start.path is None:
        return None
    if start.changes and start.step >= total_steps:
        raise RecipeError(f"checkpoint {start.path} is at step {start.step} and the run with the changed flags has "
                          f"{total_steps} steps: nothing left to train with them; start a new run (another "
                          "--output_dir, or --overwrite_output_dir)")
    if start.changes or not start.finished or not (out / "final").is_dir():
        return None
    evals = [r for r in records.read_jsonl(out / "eval.jsonl") if r["step"] <= start.step]
    kept = out / "final" / "best_model.json"  # final/ is a copy of best/ (--load_best_model_at_end)
    held = json.loads(kept.read_text()) if kept.is_file() else None
    if os.environ.get("RANK", "0") == "0":
        print(f"{out} holds a finished run (checkpoint {start.path.name}, final/): nothing to train, final/ is left "
              "as it is")
    return held or (evals[-1] if evals else {"step": start.step, "epoch": start.epoch})


def describe_best(out: Path) -> Optional[dict]:
    """best/best_model.json: the step and metric of the weights in best/; None when there are none."""
    path = out / "best" / "best_model.json"
    return json.loads(path.read_text()) if path.is_file() else None


def save_final(accelerator, model, tokenizer, out: Path, last_eval: dict, load_best: bool) -> dict:
    """Write final/: the trained weights, or with --load_best_model_at_end a copy of best/ (when an evaluation made
    one). Returns the evaluation of the weights in final/. Every rank calls it."""
    best = describe_best(out) if load_best else None
    if best is None:
        checkpoint.save_weights(accelerator, model, tokenizer, out / "final")
        return last_eval
    if accelerator.is_main_process:
        checkpoint.copy_weights(out / "best", out / "final")
    accelerator.wait_for_everyone()
    return best
