"""Matthews correlation (CoLA's metric) as an `evaluate` metric module, shipped so `evaluate.load(path)` works offline.

Multi-class form (Gorodkin's R_K, what scikit-learn computes): from the confusion counts, with t_k the true and p_k
the predicted count of class k, c the correct predictions and s all of them,
    MCC = (c s - sum_k p_k t_k) / sqrt((s^2 - sum_k p_k^2) (s^2 - sum_k t_k^2)),
and 0 when a factor under the root is 0 (one class only, on either side). For two classes it is the usual
(TP TN - FP FN) / sqrt((TP + FP)(TP + FN)(TN + FP)(TN + FN)).
"""
import datasets
import evaluate
import numpy as np


class MatthewsCorrelation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Matthews correlation coefficient between predicted and true class ids, -1 to 1.",
            citation="",
            inputs_description="predictions, references: integer class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        classes = np.union1d(predictions, references)
        t = np.array([np.sum(references == c) for c in classes], dtype=float)
        p = np.array([np.sum(predictions == c) for c in classes], dtype=float)
        c, s = float(np.sum(predictions == references)), float(len(references))
        denominator = np.sqrt((s * s - np.dot(p, p)) * (s * s - np.dot(t, t)))
        return {"matthews_correlation": float((c * s - np.dot(p, t)) / denominator) if denominator > 0 else 0.0}
