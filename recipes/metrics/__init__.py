"""Evaluation metrics, shipped as `evaluate` modules in the folders beside this file and loaded by path.

`evaluate.load("accuracy")` would fetch the module from the Hub; loading it from a local folder needs no network.
"""
from __future__ import annotations

from pathlib import Path

METRICS_DIR = Path(__file__).resolve().parent


def load_metrics() -> dict:
    """accuracy and macro-F1 (recipes/metrics/<name>/<name>.py)."""
    import evaluate

    return {name: evaluate.load(str(METRICS_DIR / name)) for name in ("accuracy", "f1")}


def compute_metrics(metrics, predictions, references) -> dict:
    acc = metrics["accuracy"].compute(predictions=predictions, references=references)["accuracy"]
    f1 = metrics["f1"].compute(predictions=predictions, references=references, average="macro")["f1"]
    return {"accuracy": float(acc), "f1": float(f1)}
