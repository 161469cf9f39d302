"""Evaluation metrics, shipped as `evaluate` modules in the folders beside this file and loaded by path.

`evaluate.load("accuracy")` would fetch the module from the Hub; loading it from a local folder needs no network.
Single label: accuracy and macro-F1; regression: Pearson and Spearman (correlation/); multi-label: micro-F1,
macro-F1 and exact match (multilabel/).
"""
from __future__ import annotations

from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent
MODULES = {"single_label": ("accuracy", "f1"), "regression": ("correlation",), "multi_label": ("multilabel",)}
# The keys compute_metrics returns per problem type, its first the problem type's main metric.
SCORES = {"single_label": ("accuracy", "f1"), "regression": ("pearson", "spearman"),
          "multi_label": ("micro_f1", "macro_f1", "exact_match")}


def load_metrics(problem_type: str = "single_label") -> dict:
    """The metric modules of the problem type (recipes/metrics/<name>/<name>.py)."""
    import evaluate

    return {name: evaluate.load(str(METRICS_DIR / name)) for name in MODULES[problem_type]}


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
    acc = metrics["accuracy"].compute(predictions=predictions, references=references)["accuracy"]
    f1 = metrics["f1"].compute(predictions=predictions, references=references, average="macro")["f1"]
    return {"accuracy": float(acc), "f1": float(f1)}
