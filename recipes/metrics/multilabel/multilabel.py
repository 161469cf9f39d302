"""Multi-label micro-F1, macro-F1 and exact match as an `evaluate` metric module, loaded by path (offline)."""
import datasets
import evaluate
import numpy as np


class MultiLabel(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Over multi-hot rows: micro-F1 (counts pooled over labels), macro-F1 (mean over the labels "
                        "present in predictions or references), exact match (rows with every label right).",
            citation="",
            inputs_description="predictions, references: multi-hot 0/1 lists of one length",
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("int64")),
                                        "references": datasets.Sequence(datasets.Value("int64"))}),
        )

    def _compute(self, predictions, references):
        p, r = np.asarray(predictions, dtype=bool), np.asarray(references, dtype=bool)
        tp, fp, fn = (p & r).sum(0).astype(float), (p & ~r).sum(0).astype(float), (~p & r).sum(0).astype(float)
        denom = 2 * tp + fp + fn
        per_label = np.divide(2 * tp, denom, out=np.zeros_like(denom), where=denom > 0)
        micro_denom = denom.sum()
        return {"micro_f1": float(2 * tp.sum() / micro_denom) if micro_denom > 0 else 0.0,
                "macro_f1": float(per_label[denom > 0].mean()) if (denom > 0).any() else 0.0,
                "exact_match": float((p == r).all(axis=1).mean())}
