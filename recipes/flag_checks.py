"""The recipe's flag values, checked before any work starts: one RecipeError line for all problems. Each concern's
module judges its own flags (schedule, kernels, compilation, profiling, LoRA, padding-free); this one gathers them.

The model source is checked in model/source.py, the launch config (YAML, DeepSpeed JSON) in checks/launch_checks.py;
this module checks what a user types on the command line, which would otherwise fail late (ZeroDivisionError in the
step plan, an index error inside the first forward) or not at all (zero epochs exits 0 after training nothing).
"""
from __future__ import annotations

from pathlib import Path

from recipes import RecipeError
from recipes.checkpoints import best_model, checkpoint
from recipes.inputs.problem import PROBLEM_TYPES
from recipes.model import adapters, compilation, kernels, padding_free
from recipes.model.source import DTYPES
from recipes.outputs import profiling
from recipes.training import schedule

TRUNCATIONS = ("longest_first", "only_first", "only_second")


def flag_problems(cfg) -> list[str]:
    problems = []
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "num_train_epochs", "max_length"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name} {getattr(cfg, name)} must be >= 1")
    for name in ("max_train_steps", "max_train_samples", "max_eval_samples", "eval_steps", "pad_to_multiple_of"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            problems.append(f"--{name} {getattr(cfg, name)} must be >= 1")
    if cfg.cpu_threads < 0:
        problems.append(f"--cpu_threads {cfg.cpu_threads} must be >= 0 (0: chosen from the machine)")
    if not cfg.learning_rate > 0:
        problems.append(f"--learning_rate {cfg.learning_rate} must be > 0")
    if not 0 < cfg.validation_split < 1:
        problems.append(f"--validation_split {cfg.validation_split} must be between 0 and 1")
    problems += schedule.schedule_problems(cfg)
    problems += kernels.flag_problems(cfg)
    problems += compilation.flag_problems(cfg)
    profile_problem = profiling.steps_problem(cfg.profile_steps, cfg.max_train_steps)  # the data may cut it further
    if profile_problem:
        problems.append(profile_problem)
    if cfg.weight_decay < 0 or not cfg.max_grad_norm > 0:
        problems.append("--weight_decay must be >= 0 and --max_grad_norm > 0")
    steps = cfg.checkpointing_steps
    if steps is not None and steps != "epoch" and not (steps.isdigit() and int(steps) > 0):
        problems.append(f"--checkpointing_steps '{steps}' must be a positive integer or 'epoch'")
    if cfg.problem_type is not None and cfg.problem_type not in PROBLEM_TYPES:
        problems.append(f"unknown --problem_type '{cfg.problem_type}' (one of {', '.join(PROBLEM_TYPES)})")
    if cfg.truncation not in TRUNCATIONS:
        problems.append(f"unknown --truncation '{cfg.truncation}' (one of {', '.join(TRUNCATIONS)})")
    if not 0 <= cfg.label_smoothing_factor < 1:
        problems.append(f"--label_smoothing_factor {cfg.label_smoothing_factor} must be in [0, 1)")
    if not 0 < cfg.multi_label_threshold < 1:
        problems.append(f"--multi_label_threshold {cfg.multi_label_threshold} must be between 0 and 1")
    if cfg.auto_micro_batch and (cfg.data_parallel or not cfg.do_train):
        problems.append("--auto_micro_batch sizes the micro-batch of each process's training: not with "
                        + ("--data_parallel (one process splits it over its GPUs)" if cfg.data_parallel
                           else "--do_train false"))
    if cfg.group_by_length and cfg.pad_to_max_length:
        problems.append("--group_by_length saves nothing with --pad_to_max_length (every batch is --max_length long): "
                        "drop one")
    for name in ("save_total_limit", "early_stopping_patience"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            problems.append(f"--{name} {getattr(cfg, name)} must be >= 1")
    from recipes.metrics import AVAILABLE, asked

    shipped = sorted({name for names in AVAILABLE.values() for name in names})
    unknown = [n for n in asked(cfg.metric_name) if n not in shipped]
    if unknown:
        problems.append(f"--metric_name {','.join(unknown)}: not a shipped metric ({', '.join(shipped)})")
    if cfg.torch_dtype not in DTYPES:
        problems.append(f"unknown --torch_dtype '{cfg.torch_dtype}' (one of {', '.join(DTYPES)})")
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
    resume = cfg.resume_from_checkpoint
    if resume and cfg.overwrite_output_dir:
        problems.append(f"--overwrite_output_dir with --resume_from_checkpoint {resume}: one continues the run in "
                        "--output_dir, the other replaces it; choose one")
    if resume and resume not in ("latest", "auto") and not Path(resume).is_dir():
        problems.append(f"--resume_from_checkpoint {resume}: not a folder, 'latest' or 'auto'")
    if cfg.metric_for_best_model is not None:  # checked again once the data tell an inferred problem type
        known_type = cfg.problem_type if cfg.problem_type in PROBLEM_TYPES else None
        problem = best_model.metric_problem(cfg.metric_for_best_model, known_type)
        if problem:
            problems.append(problem)
    if cfg.predict_file and not Path(cfg.predict_file).is_file():
        problems.append(f"predict file not found: {cfg.predict_file}")
    problems += inputs_among_outputs(cfg)
    problems += adapters.flag_problems(cfg)  # --use_peft and the LoRA flags
    problems += padding_free.flag_problems(cfg)
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


def check_flags(cfg) -> None:
    problems = flag_problems(cfg)
    if problems:
        raise RecipeError("; ".join(problems))
