"""The best model and early stopping: best/ by --metric_for_best_model, the patience count, what final/ holds, and
a relaunch of a run that has already ended. Every rank holds the same BestModel: the metrics come from gathered
predictions."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

from recipes import RecipeError
from recipes.checkpoints import checkpoint
from recipes.inputs import tasks
from recipes.metrics import AVAILABLE, SCORES
from recipes.outputs import records

# The metrics eval.jsonl reports per problem type: the scores and the evaluation's mean loss (cls.evaluate); the
# first one is the default --metric_for_best_model.
EVAL_METRICS = {problem_type: (*scores, "loss") for problem_type, scores in SCORES.items()}

# What --metric_for_best_model accepts: those, and the scores a task or --metric_name adds (a run asked to keep the
# best model by one of these reports it: tasks.extra_scores).
ACCEPTED = {problem_type: (*scores, "loss") for problem_type, scores in AVAILABLE.items()}


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


class BestModel:
    """The best-so-far and the patience count of one run."""

    def __init__(self, cfg, start):
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

    def after_eval(self, record: dict) -> bool:
        """Update the best-so-far and the patience count with an evaluation; True when it is a new best. Adds the
        state to the eval record."""
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
        """What a checkpoint keeps of it (TrainerState.long_run), for a resumed run to go on alike."""
        return {"metric": self.metric, "best_value": self.best_value, "best_step": self.best_step,
                "evals_without_improvement": self.bad_evals}

    def describe(self) -> dict:
        """For run_config.json."""
        from recipes.checkpoints.preemption import PREEMPTED_EXIT

        return {"metric_for_best_model": self.metric, "greater_is_better": self.greater_is_better,
                "early_stopping_patience": self.patience, "save_total_limit": self.keep,
                "preempted_exit_status": PREEMPTED_EXIT}


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
