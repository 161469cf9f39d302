"""The problem type: single-label classification, regression or multi-label classification.

One place decides, from the label column, which of the three a dataset is, how its labels become tensors, the loss
of a micro-batch (a SUM over its samples, so `cls.loss_scale` makes every step's gradient the exact mean for all
three), and how logits become predictions, probabilities and metric inputs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from recipes import RecipeError

PROBLEM_TYPES = ("single_label", "regression", "multi_label")
# The names transformers stores in config.problem_type; pipeline("text-classification") reads them to pick
# softmax (single label), sigmoid (multi-label) or the raw score (regression).
HF_PROBLEM_TYPE = {"single_label": "single_label_classification", "regression": "regression",
                   "multi_label": "multi_label_classification"}
MISSING = -1  # GLUE and CLUE test splits mark an unknown label as -1: such rows are predicted, never scored


def is_missing(value) -> bool:
    return value is None or value == MISSING or (isinstance(value, float) and math.isnan(value))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_multi_hot(lists: list) -> bool:
    """A multi-hot column: lists of one length, only 0/1 (or 0.0/1.0), and a repeat somewhere (a list of label
    ids never repeats an id, a multi-hot row with two labels or more does, e.g. [0, 1, 1])."""
    if any(any(not _is_number(x) or x not in (0, 1) for x in row) for row in lists):
        return False
    if len({len(row) for row in lists}) != 1:
        return False
    return any(isinstance(x, float) for row in lists for x in row) or any(len(set(row)) < len(row) for row in lists)


def infer_problem_type(values: list, is_class_label: bool = False) -> str:
    """float labels -> regression; list labels -> multi-label; everything else -> single label."""
    present = [v for v in values if not is_missing(v)]
    if is_class_label or not present:
        return "single_label"
    if all(isinstance(v, list) for v in present):
        return "multi_label"
    if all(_is_number(v) for v in present) and any(isinstance(v, float) and not float(v).is_integer() for v in present):
        return "regression"
    return "single_label"


def label_names(problem_type: str, values: list, label_column: str, class_names: list | None = None) -> list[str]:
    """The output names, index = logit index: one name (the label column) for regression, the classes otherwise."""
    present = [v for v in values if not is_missing(v)]
    if problem_type == "regression":
        bad = next((v for v in present if not _is_number(v)), None)
        if bad is not None:
            raise RecipeError(f"regression labels must be numbers, found {bad!r} in column '{label_column}'")
        return [label_column]
    if class_names is not None:
        return list(class_names)
    if problem_type == "multi_label":
        if not all(isinstance(v, list) for v in present):
            bad = next(v for v in present if not isinstance(v, list))
            raise RecipeError(f"multi-label labels must be lists (of names or ids, or multi-hot), found {bad!r} "
                              f"in column '{label_column}'")
        if present and is_multi_hot(present):
            return [str(i) for i in range(len(present[0]))]
        present = [x for row in present for x in row]
    elif any(isinstance(v, list) for v in present):
        raise RecipeError(f"--problem_type single_label but column '{label_column}' holds lists: use multi_label")
    if present and all(isinstance(v, str) for v in present):
        return sorted(set(present))
    # CSV readers turn an int column with empty cells into floats (1.0, nan): those are still class ids.
    present = [int(v) if isinstance(v, float) and v.is_integer() else v for v in present]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        if present and min(present) < 0:
            raise RecipeError(f"integer labels must be >= 0, found {min(present)} in column '{label_column}'")
        return [str(i) for i in range(max(present, default=0) + 1)]
    if problem_type == "single_label" and all(_is_number(v) for v in present):
        raise RecipeError(f"labels must be ints or strings, found {next(v for v in present if isinstance(v, float))!r}"
                          f" (float) in '{label_column}'; for a score use --problem_type regression")
    bad = next(v for v in present if not isinstance(v, (int, str)) or isinstance(v, bool))
    raise RecipeError(f"labels must be ints or strings, found {bad!r} ({type(bad).__name__}) in '{label_column}'")


class LabelEncoder:
    """Turns one row's label into what the loss takes: a class id, a float, or a multi-hot float list."""

    def __init__(self, problem_type: str, names: list[str], label_column: str, multi_hot: bool = False):
        self.problem_type, self.names, self.column, self.multi_hot = problem_type, names, label_column, multi_hot
        self.to_id = {n: i for i, n in enumerate(names)}

    def _class_id(self, v, split: str) -> int:
        if isinstance(v, str):
            if v not in self.to_id:
                raise RecipeError(f"{split} data has label '{v}' in column '{self.column}' that the training data "
                                  f"never has (known: {', '.join(self.names)})")
            return self.to_id[v]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or not 0 <= v < len(self.names):
            raise RecipeError(f"{split} data has label {v!r} in column '{self.column}' outside 0..{len(self.names) - 1}")
        return v

    def __call__(self, v, split: str):
        if self.problem_type == "regression":
            if is_missing(v):
                return float("nan")
            if not _is_number(v):
                raise RecipeError(f"regression labels must be numbers, found {v!r} in column '{self.column}'")
            return float(v)
        if self.problem_type == "multi_label":
            if is_missing(v):
                return [float(MISSING)] * len(self.names)
            if not isinstance(v, list):
                raise RecipeError(f"multi-label labels must be lists, found {v!r} in column '{self.column}'")
            if self.multi_hot:
                if len(v) != len(self.names) or any(not _is_number(x) or x not in (0, 1) for x in v):
                    raise RecipeError(f"{split} data has multi-hot label {v!r} in column '{self.column}'; expected "
                                      f"{len(self.names)} values of 0 or 1")
                return [float(x) for x in v]
            hot = [0.0] * len(self.names)
            for x in v:
                hot[self._class_id(x, split)] = 1.0
            return hot
        return MISSING if is_missing(v) else self._class_id(v, split)


def hf_labels_config(problem_type: str, names: list[str]) -> dict:
    """The model config keys: num_labels, id2label, label2id, problem_type (saved in final/config.json)."""
    return dict(num_labels=len(names), id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)},
                problem_type=HF_PROBLEM_TYPE[problem_type])


def loss_sum(problem_type: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The micro-batch's loss summed over its samples (per-sample losses as transformers defines them).

    Regression: squared error of the one output. Multi-label: binary cross-entropy averaged over the labels of a
    sample (as transformers' BCEWithLogitsLoss mean does), summed over the samples. The sum, never the mean, so that
    `cls.loss_scale` turns any window of micro-batches into the exact mean over the window's samples.
    """
    logits = logits.float()
    if problem_type == "regression":
        return F.mse_loss(logits.squeeze(-1), labels.float(), reduction="sum")
    if problem_type == "multi_label":
        return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="sum") / logits.shape[-1]
    return F.cross_entropy(logits, labels, reduction="sum")


class TrainingLoss:
    """The training loss of a micro-batch, as a SUM (see loss_sum), with --class_weights and --label_smoothing_factor.

    Single-label with class weights w: the sum of w[y_i] x loss_i, which the loop divides by the window's weight sum
    (the sum of w[y_i] over the window's samples on all ranks; `data.Loaders.window_weights`) instead of its sample
    count: the step's gradient is then torch's weighted mean (`F.cross_entropy(weight=w)`, reduction "mean") over
    the whole window, whatever the accumulation, world size or partial last window. Derivation, with cls.loss_scale's
    s = accum x world / W: each rank's accumulated gradient is s / accum x the sum of its micro-batches' gradients,
    the reduction averages over the world, so g = s / (accum x world) x sum over the window of grad(w[y_i] loss_i)
    = (1 / W) x sum of grad(w[y_i] loss_i), the weighted mean, given W before the window's first backward.
    Label smoothing (single-label only): torch's `label_smoothing`, the Trainer's label_smoothing_factor; with class
    weights as torch combines them (the smoothed term weighted per class, the sum still divided by W).
    Multi-label with class weights: they are BCE's pos_weight per label; torch's mean over the label entries does not
    divide by them, so the normaliser stays the sample count.
    Evaluation keeps the plain loss (`loss_sum`): comparable between runs whatever their weights.
    """

    def __init__(self, problem_type: str, weights: torch.Tensor | None = None, smoothing: float = 0.0):
        self.problem_type, self.weights, self.smoothing = problem_type, weights, smoothing

    @classmethod
    def of(cls, cfg, names: list[str], train_ds) -> "TrainingLoss":
        """From the flags and the training labels; RecipeError in one line for a combination it cannot train."""
        kind = cfg.problem_type
        if cfg.label_smoothing_factor and kind != "single_label":
            raise RecipeError(f"--label_smoothing_factor applies to single-label classification, not {kind}; drop it")
        if cfg.class_weights is None:
            return cls(kind, None, cfg.label_smoothing_factor)
        if kind == "regression":
            raise RecipeError("--class_weights: a regression has no classes; drop it")
        if cfg.class_weights == "balanced":
            values = balanced_weights(kind, names, train_ds["labels"][:])
        else:
            values = explicit_weights(cfg.class_weights, names)
        return cls(kind, torch.tensor(values, dtype=torch.float32), cfg.label_smoothing_factor)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.weights is None and not self.smoothing:
            return loss_sum(self.problem_type, logits, labels)
        logits = logits.float()
        weights = None if self.weights is None else self.weights.to(logits.device)
        if self.problem_type == "multi_label":
            return F.binary_cross_entropy_with_logits(logits, labels.float(), pos_weight=weights,
                                                      reduction="sum") / logits.shape[-1]
        return F.cross_entropy(logits, labels, weight=weights, reduction="sum", label_smoothing=self.smoothing)

    def sample_weights(self, train_ds) -> list | None:
        """Each training sample's weight in the window normaliser (single-label class weights), else None: the
        normaliser is the sample count."""
        if self.weights is None or self.problem_type != "single_label":
            return None
        table = self.weights.tolist()
        return [table[y] for y in train_ds["labels"][:]]


def balanced_weights(kind: str, names: list[str], labels: list) -> list[float]:
    """scikit-learn's compute_class_weight("balanced"): n / (classes x count of each class); multi-label: pos_weight
    = negatives / positives per label."""
    n = len(labels)
    if kind == "multi_label":
        positives = torch.tensor(labels, dtype=torch.float64).sum(dim=0).tolist()
        empty = [name for name, p in zip(names, positives) if p == 0]
        if empty:
            raise RecipeError(f"--class_weights balanced: label '{empty[0]}' is positive in no training example")
        return [(n - p) / p for p in positives]
    counts = torch.bincount(torch.tensor(labels), minlength=len(names)).tolist()
    empty = [name for name, c in zip(names, counts) if c == 0]
    if empty:
        raise RecipeError(f"--class_weights balanced: class '{empty[0]}' has no training example")
    return [n / (len(names) * c) for c in counts]


def explicit_weights(text: str, names: list[str]) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise RecipeError(f"--class_weights '{text}': 'balanced' or one number per label, comma-separated") from None
    if len(values) != len(names):
        raise RecipeError(f"--class_weights has {len(values)} values for {len(names)} labels ({', '.join(names)}), "
                          "in that order")
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise RecipeError(f"--class_weights '{text}': every weight must be a positive number")
    return values


def scored(problem_type: str, labels: torch.Tensor) -> torch.Tensor:
    """The rows that have a label (the others are predicted, not scored)."""
    if problem_type == "regression":
        return ~torch.isnan(labels)
    if problem_type == "multi_label":
        return (labels >= 0).all(dim=-1)
    return labels >= 0


def probabilities(problem_type: str, logits: torch.Tensor) -> torch.Tensor | None:
    logits = logits.float()
    if problem_type == "single_label":
        return logits.softmax(dim=-1)
    if problem_type == "multi_label":
        return logits.sigmoid()
    return None


def predictions(problem_type: str, logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Class ids (single label), scores (regression) or multi-hot 0/1 ints (multi-label, probability >= threshold)."""
    if problem_type == "regression":
        return logits.float().squeeze(-1)
    if problem_type == "multi_label":
        return (logits.float().sigmoid() >= threshold).long()
    return logits.argmax(dim=-1)


def prediction_record(problem_type: str, row: int, logits: torch.Tensor, names: list[str], threshold: float) -> dict:
    """One line of predictions.jsonl: the row index, the label name(s) or score, and the probabilities."""
    pred = predictions(problem_type, logits.unsqueeze(0), threshold)[0]
    probs = probabilities(problem_type, logits.unsqueeze(0))
    if problem_type == "regression":
        return {"row": row, "prediction": float(pred)}
    record = {"row": row, "probabilities": {n: float(p) for n, p in zip(names, probs[0])}}
    if problem_type == "multi_label":
        record["prediction"] = [n for n, hot in zip(names, pred.tolist()) if hot]
    else:
        record["prediction"] = names[int(pred)]
    return record
