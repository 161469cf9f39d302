"""F1 (macro by default; micro; binary: of the positive class) as an `evaluate` metric module, shipped so
`evaluate.load(path)` works offline."""
import datasets
import evaluate
import numpy as np


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="F1 per class from the confusion counts; 'macro' averages over the classes present.",
            citation="",
            inputs_description="predictions, references: integer class ids; average: 'macro', 'micro' or 'binary'",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="macro"):
        predictions, references = np.asarray(predictions), np.asarray(references)
        # 'binary': the F1 of the positive class (id 1), what GLUE reports for MRPC and QQP
        classes = np.array([1]) if average == "binary" else np.union1d(predictions, references)
        tp = np.array([np.sum((predictions == c) & (references == c)) for c in classes], dtype=float)
        fp = np.array([np.sum((predictions == c) & (references != c)) for c in classes], dtype=float)
        fn = np.array([np.sum((predictions != c) & (references == c)) for c in classes], dtype=float)
        if average == "micro":
            tp, fp, fn = tp.sum(), fp.sum(), fn.sum()
        denom = 2 * tp + fp + fn
        f1 = np.divide(2 * tp, denom, out=np.zeros_like(denom), where=denom > 0)
        return {"f1": float(np.mean(f1))}
