"""Pearson and Spearman correlation (regression) as an `evaluate` metric module, loaded by path (offline)."""
import datasets
import evaluate
import numpy as np


def _ranks(x):
    """Ranks 1..n, ties sharing their mean rank (what Spearman's coefficient needs)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=float)
    ranks[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def _pearson(x, y):
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denom) if denom > 0 else 0.0


class Correlation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Pearson's r and Spearman's rho between predicted and reference scores (0 when constant).",
            citation="",
            inputs_description="predictions, references: floats",
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("float64")}),
        )

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions, dtype=float), np.asarray(references, dtype=float)
        return {"pearson": _pearson(p, r), "spearman": _pearson(_ranks(p), _ranks(r))}
