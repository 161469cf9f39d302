"""The learning-rate schedule: transformers' `get_scheduler` by name, warm-up as TrainingArguments reads it.

`--lr_scheduler_type` takes the names of transformers 5.23's SchedulerType (`linear`, the default, `cosine`,
`cosine_with_restarts`, `polynomial`, `constant`, `constant_with_warmup`, `inverse_sqrt`, `cosine_with_min_lr`,
`cosine_warmup_with_min_lr`, `warmup_stable_decay`) and `--lr_scheduler_kwargs` a JSON object of the extra arguments
some need (`{"min_lr_rate": 0.1}` for the min-lr cosines, `{"num_cycles": 2}`, ...). The two that adapt to a metric
(`reduce_lr_on_plateau`, `greedy`) are refused: the recipe steps the schedule once per optimizer step, with no
metric, so they would never change the rate. The schedule's state is saved in every checkpoint (Accelerate's
`save_state`) and depends only on the step count, so a resumed run, or one on another world size with the same
global batch, follows the same rates.

Warm-up: `--warmup_steps N` as transformers 5.23 reads it (`TrainingArguments.get_warmup_steps`): N >= 1 is a number
of steps, N < 1 a fraction of them, rounded up. Without it, `--warmup_ratio` (default 0.06, rounded down, as the
recipe always did). Giving both is an error.
"""
from __future__ import annotations

import json
import math

DEFAULT_WARMUP_RATIO = 0.06
NEEDS_A_METRIC = ("reduce_lr_on_plateau", "greedy")


def scheduler_names() -> list[str]:
    from transformers.trainer_utils import SchedulerType

    return [t.value for t in SchedulerType if t.value not in NEEDS_A_METRIC]


def warmup_steps(cfg, total_steps: int) -> int:
    if cfg.warmup_steps is not None:
        steps = cfg.warmup_steps
        return int(steps) if steps >= 1 else math.ceil(total_steps * steps)
    ratio = DEFAULT_WARMUP_RATIO if cfg.warmup_ratio is None else cfg.warmup_ratio
    return int(ratio * total_steps)


def scheduler_kwargs(cfg) -> dict:
    return json.loads(cfg.lr_scheduler_kwargs) if cfg.lr_scheduler_kwargs else {}


def build_scheduler(cfg, optimizer, total_steps: int):
    from transformers import get_scheduler

    return get_scheduler(cfg.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps(cfg, total_steps),
                         num_training_steps=total_steps, scheduler_specific_kwargs=scheduler_kwargs(cfg))


def schedule_problems(cfg) -> list[str]:
    """The schedule flags' problems, one line each; the schedule is built once on a throw-away optimizer, so that a
    missing or unknown scheduler argument fails here rather than after the data and the model are loaded."""
    import torch

    if cfg.lr_scheduler_type in NEEDS_A_METRIC:
        return [f"--lr_scheduler_type {cfg.lr_scheduler_type} adapts to a metric, which the recipe does not pass to "
                f"the schedule; use one of {', '.join(scheduler_names())}"]
    if cfg.lr_scheduler_type not in scheduler_names():
        return [f"--lr_scheduler_type {cfg.lr_scheduler_type} is not one of {', '.join(scheduler_names())}"]
    problems = []
    if cfg.warmup_steps is not None and cfg.warmup_ratio is not None:
        problems.append("--warmup_steps and --warmup_ratio both given: --warmup_steps N takes a number of steps "
                        "(N >= 1) or a fraction (N < 1); drop --warmup_ratio")
    if cfg.warmup_steps is not None and (cfg.warmup_steps < 0 or cfg.warmup_steps >= 1 and cfg.warmup_steps % 1):
        problems.append(f"--warmup_steps {cfg.warmup_steps} must be a whole number of steps >= 1 or a fraction in "
                        "[0, 1)")
    if cfg.warmup_ratio is not None and not 0 <= cfg.warmup_ratio <= 1:
        problems.append(f"--warmup_ratio {cfg.warmup_ratio} must be between 0 and 1")
    try:
        kwargs = scheduler_kwargs(cfg)
    except json.JSONDecodeError as err:
        return problems + [f"--lr_scheduler_kwargs is not JSON ({err.msg}): give an object such as "
                           "'{\"num_cycles\": 2}'"]
    if not isinstance(kwargs, dict):
        return problems + ["--lr_scheduler_kwargs must be a JSON object such as '{\"num_cycles\": 2}'"]
    if problems:
        return problems
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        build_scheduler(cfg, optimizer, total_steps=100)
    except (TypeError, ValueError, AssertionError) as err:
        return [f"--lr_scheduler_type {cfg.lr_scheduler_type} with --lr_scheduler_kwargs {json.dumps(kwargs)}: "
                f"{' '.join(str(err).split())}"]
    return []
