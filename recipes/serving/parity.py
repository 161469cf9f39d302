"""Is the exported model the trained one? ONNX Runtime's logits against PyTorch's on the same batches, and the same
decision wherever the decision is not a near-tie; the scores of a model on labelled rows.

A decision's margin: single-label, the top logit less the second (PyTorch's); multi-label, the nearest distance of a
label's logit to the logit of its threshold; regression has no decision (its prediction is the logit, held by the
logit bound). Rows whose margin is at most TIE_MARGIN are near-ties: counted and reported, not held to the same label,
since a difference within the logit bound may flip them.
"""
from __future__ import annotations

import math

import torch

from recipes import RecipeError
from recipes.inputs import problem
from recipes.metrics import compute_metrics, load_metrics

MAX_ABS_DIFFERENCE = 1e-4  # fp32: ONNX Runtime's logits within this of PyTorch's
TIE_MARGIN = 1e-4


def margins(problem_type: str, logits: torch.Tensor, threshold) -> torch.Tensor:
    """Each row's decision margin (inf for regression)."""
    logits = logits.double()
    if problem_type == "single_label":
        top = logits.topk(2, dim=-1).values
        return top[:, 0] - top[:, 1]
    if problem_type == "multi_label":
        t = torch.as_tensor(threshold, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
        return (logits - (t.log() - (-t).log1p())).abs().min(dim=-1).values
    return torch.full((len(logits),), math.inf, dtype=torch.float64)


def compare(problem_type: str, reference: torch.Tensor, exported: torch.Tensor, threshold) -> dict:
    """The largest logit difference, the near-ties, and the rows whose decision differs beyond them."""
    tie = margins(problem_type, reference, threshold) <= TIE_MARGIN
    if problem_type == "regression":
        differs = torch.zeros(len(reference), dtype=torch.bool)
    else:
        a = problem.predictions(problem_type, reference, threshold)
        b = problem.predictions(problem_type, exported, threshold)
        differs = (a != b).reshape(len(a), -1).any(dim=-1)
    return {"examples": len(reference), "max_abs_logit_difference": float((reference - exported).abs().max()),
            "near_ties": int(tie.sum()), "decisions_differing_at_near_ties": int((differs & tie).sum()),
            "decisions_differing": int((differs & ~tie).sum())}


def check(result: dict, what: str) -> None:
    """A RecipeError line unless `result` (compare's) holds the bounds."""
    if result["max_abs_logit_difference"] > MAX_ABS_DIFFERENCE or result["decisions_differing"]:
        raise RecipeError(f"the ONNX graph does not reproduce the model on {what}: max |logit difference| "
                          f"{result['max_abs_logit_difference']:.2e} (bound {MAX_ABS_DIFFERENCE:g}), "
                          f"{result['decisions_differing']} of {result['examples']} decisions differ beyond the "
                          f"near-ties; nothing exported")


def scores(problem_type: str, logits: torch.Tensor, labels: torch.Tensor, threshold) -> dict:
    """The run's metrics (accuracy, f1_macro; pearson; micro_f1 ...) over the labelled rows; {} without labels."""
    keep = problem.scored(problem_type, labels)
    if not keep.any():
        return {}
    predicted = problem.predictions(problem_type, logits[keep], threshold)
    return {**compute_metrics(load_metrics(problem_type), predicted, labels[keep]), "n_examples": int(keep.sum())}
