"""The recipe's flag values, checked before any work starts: one RecipeError line for all problems.

A flag's own check sits beside it in recipes/config.py (`flag(..., check=...)`, made of the checks below); what
depends on several flags is judged here, and each concern's module judges its own combinations (schedule, kernels,
compilation, profiling, LoRA, padding-free, trackers). The model source is checked in model/source.py, the launch
config in checks/launch_checks.py. Without these, bad values fail late (ZeroDivisionError in the step plan, an index
error inside the first forward) or not at all (zero epochs exits 0 after training nothing).
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from recipes import RecipeError
from recipes.checkpoints import best_model, checkpoint
from recipes.inputs import streaming
from recipes.inputs.problem import PROBLEM_TYPES
from recipes.model import adapters, compilation, kernels, padding_free
from recipes.outputs import profiling
from recipes.training import schedule

TRUNCATIONS = ("longest_first", "only_first", "only_second")


# --- one flag's checks: each takes the flag's name and value and returns its problem, or None ---------------------
def at_least(low, note: str = ""):
    def check(name, value):
        return f"--{name} {value} must be >= {low}{note}" if value is not None and value < low else None
    return check


def above(low):
    def check(name, value):
        return f"--{name} {value} must be > {low}" if value is not None and not value > low else None
    return check


def between(low, high):
    def check(name, value):
        return f"--{name} {value} must be between {low} and {high}" if not low < value < high else None
    return check


def in_unit_interval(name, value):
    return f"--{name} {value} must be in [0, 1)" if not 0 <= value < 1 else None


def one_of(choices):
    def check(name, value):
        return f"unknown --{name} '{value}' (one of {', '.join(choices)})" if value is not None and value not in \
            choices else None
    return check


def steps_or_epoch(name, value):
    if value is None or value == "epoch" or (value.isdigit() and int(value) > 0):
        return None
    return f"--{name} '{value}' must be a positive integer or 'epoch'"


def checkpoint_source(name, value):
    if not value or value in ("latest", "auto") or Path(value).is_dir():
        return None
    return f"--{name} {value}: not a folder, 'latest' or 'auto'"


def existing_file(name, value):
    return f"predict file not found: {value}" if value and not Path(value).is_file() else None


def shipped_metrics(name, value):
    from recipes.metrics import AVAILABLE, asked

    shipped = sorted({n for names in AVAILABLE.values() for n in names})
    unknown = [n for n in asked(value) if n not in shipped]
    return f"--{name} {','.join(unknown)}: not a shipped metric ({', '.join(shipped)})" if unknown else None


# --- all flags --------------------------------------------------------------------------------------------------
def field_problems(cfg) -> list[str]:
    """Each flag's own check (config.py's `check=`), in the flags' order."""
    problems = (f.metadata["check"](f.name, getattr(cfg, f.name)) for f in fields(cfg) if f.metadata.get("check"))
    return [p for p in problems if p]


def run_problems(cfg) -> list[str]:
    """What training, evaluation, prediction and resuming ask of each other."""
    problems = []
    if cfg.auto_micro_batch and (cfg.data_parallel or not cfg.do_train):
        problems.append("--auto_micro_batch sizes the micro-batch of each process's training: not with "
                        + ("--data_parallel (one process splits it over its GPUs)" if cfg.data_parallel
                           else "--do_train false"))
    if cfg.group_by_length and cfg.pad_to_max_length:
        problems.append("--group_by_length saves nothing with --pad_to_max_length (every batch is --max_length long): "
                        "drop one")
    if not cfg.do_train:
        if cfg.overwrite_output_dir:
            problems.append("--do_train false with --overwrite_output_dir: a run without training never replaces a "
                            "run's outputs; give another --output_dir")
        if cfg.resume_from_checkpoint:
            problems.append("--do_train false with --resume_from_checkpoint: there is no training to resume")
        if not cfg.do_eval and not (cfg.do_predict or cfg.predict_file):
            problems.append("--do_train false --do_eval false: nothing to do; add --do_predict or --predict_file")
    elif not cfg.do_eval:
        problems.append("--do_eval false goes with --do_train false: training evaluates (best model, early stop)")
    if cfg.load_best_model_at_end and (cfg.do_predict or cfg.predict_file):
        problems.append("--load_best_model_at_end with predictions: they would come from the last step's weights, "
                        "not the best; predict in a second run from <output_dir>/final")
    if cfg.resume_from_checkpoint and cfg.overwrite_output_dir:
        problems.append(f"--overwrite_output_dir with --resume_from_checkpoint {cfg.resume_from_checkpoint}: one "
                        "continues the run in --output_dir, the other replaces it; choose one")
    if cfg.metric_for_best_model is not None:  # checked again once the data tell an inferred problem type
        known_type = cfg.problem_type if cfg.problem_type in PROBLEM_TYPES else None
        problem = best_model.metric_problem(cfg.metric_for_best_model, known_type)
        if problem:
            problems.append(problem)
    return problems


def inputs_among_outputs(cfg) -> list[str]:
    """A training run's inputs inside an output it replaces (a run's final/ re-tuned into its own folder): the model
    LoRA's merge reads again at every save, or a data file, would be gone or changed under the run."""
    if not cfg.do_train:
        return []  # a run without training never changes a training run's outputs (checkpoint.find_checkpoint)
    out = Path(cfg.output_dir).resolve()
    problems = []
    for flag in ("model_name_or_path", "tokenizer_name", "train_file", "validation_file", "predict_file"):
        value = getattr(cfg, flag)
        path = Path(value).resolve() if value and Path(value).exists() else None
        inside = [name for name in checkpoint.RUN_OUTPUTS if path and (path == out / name or out / name in path.parents)]
        if inside:
            problems.append(f"--{flag} {value} is inside {inside[0]}/ of --output_dir, which this run replaces: copy "
                            "it elsewhere first, or train into another --output_dir")
    return problems


def flag_problems(cfg) -> list[str]:
    profile_problem = profiling.steps_problem(cfg.profile_steps, cfg.max_train_steps)  # the data may cut it further
    return [*field_problems(cfg), *schedule.schedule_problems(cfg), *kernels.flag_problems(cfg),
            *compilation.flag_problems(cfg), *([profile_problem] if profile_problem else []), *run_problems(cfg),
            *inputs_among_outputs(cfg), *adapters.flag_problems(cfg), *padding_free.flag_problems(cfg),
            *streaming.flag_problems(cfg)]


def check_flags(cfg) -> None:
    problems = flag_problems(cfg)
    if problems:
        raise RecipeError("; ".join(problems))
