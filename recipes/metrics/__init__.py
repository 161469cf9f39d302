"""Evaluation metrics, shipped as `evaluate` modules in the folders beside this file and loaded by path.

`evaluate.load("accuracy")` would fetch the module from the Hub; loading it from a local folder needs no network.
Each score has one name that never changes meaning (eval.jsonl, trackers, the model card, --metric_for_best_model):

- single label: `accuracy` and `f1_macro` always; `f1` (of the positive class, id 1: two classes only) and
  `matthews_correlation` where a task is judged by them (recipes/inputs/tasks.py) or --metric_name asks;
- regression: `pearson`, `spearman` (correlation/); multi-label: `micro_f1`, `macro_f1`, `exact_match` (multilabel/).
"""
from __future__ import annotations

from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent
# The scores every evaluation of a problem type reports, its main metric first.
SCORES = {"single_label": ("accuracy", "f1_macro"), "regression": ("pearson", "spearman"),
          "multi_label": ("micro_f1", "macro_f1", "exact_match")}
# Single-label scores a task or --metric_name adds: (module folder, compute arguments, key of its result).
EXTRA = {"f1": ("f1", {"average": "binary"}, "f1"),
         "matthews_correlation": ("matthews_correlation", {}, "matthews_correlation")}
SINGLE_LABEL = {"accuracy": ("accuracy", {}, "accuracy"), "f1_macro": ("f1", {"average": "macro"}, "f1"), **EXTRA}
AVAILABLE = {"single_label": tuple(SINGLE_LABEL), "regression": SCORES["regression"],
             "multi_label": SCORES["multi_label"]}


def asked(metric_name) -> tuple:
    """The score names of --metric_name (comma- or space-separated), in order."""
    return tuple((metric_name or "").replace(",", " ").split())


def score_names(problem_type: str, extra=()) -> tuple:
    """The scores an evaluation reports: the problem type's, then the `extra` ones it does not have yet."""
    return tuple(dict.fromkeys((*SCORES[problem_type], *extra)))


def check_scores(problem_type: str, extra, n_classes: int) -> None:
    """A RecipeError for an `extra` score this run cannot report: another problem type's, or the F1 of the positive
    class on more than two classes."""
    from recipes import RecipeError

    wrong = [name for name in extra if name not in AVAILABLE[problem_type]]
    if wrong:
        raise RecipeError(f"--metric_name {','.join(wrong)}: a {problem_type} problem reports "
                          f"{', '.join(AVAILABLE[problem_type])}")
    if "f1" in extra and problem_type == "single_label" and n_classes != 2:
        raise RecipeError(f"f1 is the F1 of the positive class of a 2-class problem; this one has {n_classes} "
                          "classes: use f1_macro")


def load_metrics(problem_type: str = "single_label", extra=()) -> dict:
    """The metric modules of the problem type and of `extra` scores (recipes/metrics/<name>/<name>.py)."""
    import evaluate

    if problem_type == "regression":
        return {"correlation": evaluate.load(str(METRICS_DIR / "correlation"))}
    if problem_type == "multi_label":
        return {"multilabel": evaluate.load(str(METRICS_DIR / "multilabel"))}
    names = score_names(problem_type, extra)
    modules = {folder: evaluate.load(str(METRICS_DIR / folder)) for folder in {SINGLE_LABEL[n][0] for n in names}}
    return {name: (modules[SINGLE_LABEL[name][0]], *SINGLE_LABEL[name][1:]) for name in names}


def compute_metrics(metrics, predictions, references) -> dict:
    """The scores of `metrics` (from load_metrics): predictions as the problem's predictions (class ids, scores, or
    multi-hot rows), references alike."""
    if "correlation" in metrics:
        scores = metrics["correlation"].compute(predictions=predictions.tolist(), references=references.tolist())
        return {k: float(v) for k, v in scores.items()}
    if "multilabel" in metrics:
        scores = metrics["multilabel"].compute(predictions=predictions.long().tolist(),
                                               references=references.long().tolist())
        return {k: float(v) for k, v in scores.items()}
    return {name: float(module.compute(predictions=predictions, references=references, **kwargs)[key])
            for name, (module, kwargs, key) in metrics.items()}
