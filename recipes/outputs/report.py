"""The evaluation report: <output_dir>/eval_report/, written by rank 0 at the end of a run (--eval_report, on by
default) from the predictions `gather_for_metrics` gathered, every validation example counted once on any strategy.

It describes the evaluation whose weights final/ holds: the last one, or with --load_best_model_at_end the best one
when this process made it (a run resumed after its best evaluation reports its last one and says so); with
--do_train false, the one evaluation.
- report.json, single-label: per-class precision, recall, F1 and support, their macro means, accuracy, the confusion
  matrix (rows: true label, columns: predicted) and calibration: the expected calibration error over ECE_BINS
  equal-width bins of the top probability (sum over bins of bin share x |accuracy - mean confidence|), bin by bin.
- multi-label: per-label precision, recall, F1, support and 2 x 2 confusion at --multi_label_threshold, and the
  threshold that maximises each label's F1 on this validation set (with that F1).
- regression: MAE, RMSE, R^2, the residuals' mean and standard deviation.
- PNGs: confusion_matrix.png (counts, label names), reliability.png (accuracy vs confidence per bin), or for a
  regression scatter.png (predicted vs true) and residuals.png.
scikit-learn computes the scores (a pinned dependency); matplotlib draws (the `report` extra): without it the run says
so in one line and writes report.json only. Both are imported here, when a report is written.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

ECE_BINS = 15
FOLDER = "eval_report"
# what Kept.held says when the outputs it has are not of final/'s weights (--calibrate then skips)
NOT_FINAL = "last evaluation: final/ holds the best one, made before this run resumed"


class Kept:
    """The gathered outputs (logits, labels, step) of the last evaluation and of the best one, as the run makes them."""

    def __init__(self):
        self.last = self.best = None

    def record(self, outputs: dict, best: bool) -> None:
        self.last = outputs
        if best:
            self.best = outputs

    def held(self, final_is_best: bool) -> tuple[dict | None, str]:
        """The outputs of final/'s weights, and what they are."""
        if not final_is_best:
            return self.last, "last evaluation"
        if self.best is not None:
            return self.best, "best evaluation (--load_best_model_at_end)"
        return self.last, NOT_FINAL


def calibration(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> dict:
    """Expected calibration error of the top-class probability, and its bins."""
    confidence, predicted = probs.max(dim=-1)
    correct = (predicted == labels).double()
    edges = torch.linspace(0, 1, bins + 1, dtype=torch.float64)
    index = torch.bucketize(confidence.double(), edges[1:-1], right=True)  # bin b holds (edges[b], edges[b + 1]]
    rows, ece = [], 0.0
    for b in range(bins):
        members = index == b
        count = int(members.sum())
        row = {"lower": float(edges[b]), "upper": float(edges[b + 1]), "count": count}
        if count:
            row.update(confidence=float(confidence[members].double().mean()), accuracy=float(correct[members].mean()))
            ece += count / len(labels) * abs(row["accuracy"] - row["confidence"])
        rows.append(row)
    return {"ece": ece, "bins": bins, "per_bin": rows}


def single_label(logits: torch.Tensor, labels: torch.Tensor, names: list[str]) -> dict:
    from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

    probs = logits.float().softmax(dim=-1)
    y, pred, ids = labels.numpy(), probs.argmax(dim=-1).numpy(), list(range(len(names)))
    p, r, f, s = precision_recall_fscore_support(y, pred, labels=ids, zero_division=0)
    return {"accuracy": float(accuracy_score(y, pred)),
            "per_class": {n: {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]), "support": int(s[i])}
                          for i, n in enumerate(names)},
            "macro": {"precision": float(p.mean()), "recall": float(r.mean()), "f1": float(f.mean())},
            "confusion_matrix": {"labels": names, "true_by_predicted": confusion_matrix(y, pred, labels=ids).tolist()},
            "calibration": calibration(probs, labels)}


def multi_label(logits: torch.Tensor, labels: torch.Tensor, names: list[str], threshold: float) -> dict:
    from sklearn.metrics import multilabel_confusion_matrix, precision_recall_curve, precision_recall_fscore_support

    probs, y = logits.float().sigmoid().numpy(), labels.long().numpy()
    pred = (probs >= threshold).astype(int)
    p, r, f, s = precision_recall_fscore_support(y, pred, average=None, zero_division=0)
    confusion = multilabel_confusion_matrix(y, pred)
    per_label = {}
    for i, name in enumerate(names):
        best = {"threshold": None, "f1": None}
        if y[:, i].any():
            precision, recall, cuts = precision_recall_curve(y[:, i], probs[:, i])
            f1 = 2 * precision[:-1] * recall[:-1] / (precision[:-1] + recall[:-1]).clip(min=1e-12)
            k = int(f1.argmax())
            best = {"threshold": float(cuts[k]), "f1": float(f1[k])}
        per_label[name] = {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]), "support": int(s[i]),
                           "confusion_tn_fp_fn_tp": confusion[i].ravel().tolist(), "best_f1_threshold": best}
    return {"threshold": threshold, "per_label": per_label,
            "macro": {"precision": float(p.mean()), "recall": float(r.mean()), "f1": float(f.mean())}}


def regression(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    pred, y = logits.float().squeeze(-1).numpy(), labels.float().numpy()
    residuals = pred - y
    return {"mae": float(mean_absolute_error(y, pred)), "rmse": float(mean_squared_error(y, pred) ** 0.5),
            "r2": float(r2_score(y, pred)), "residual_mean": float(residuals.mean()),
            "residual_std": float(residuals.std())}


def write(cfg, out: Path, outputs: dict | None, what: str, names: list[str], say=print) -> dict | None:
    """<out>/eval_report/report.json and its PNGs; rank 0 calls it. Returns the report; None when no evaluation
    was made."""
    if outputs is None:
        return None
    logits, labels, kind = outputs["logits"], outputs["references"], cfg.problem_type
    scores = (single_label(logits, labels, names) if kind == "single_label" else
              multi_label(logits, labels, names, cfg.multi_label_threshold) if kind == "multi_label" else
              regression(logits, labels))
    folder = out / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    report = {"problem_type": kind, "step": outputs["step"], "evaluation": what, "n_examples": len(labels), **scores}
    (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        import matplotlib
    except ImportError:
        say(f"eval report: {folder / 'report.json'} only; its PNGs need matplotlib (pip install -e '.[report]')")
        return report
    matplotlib.use("Agg")  # files only, no display
    draw(folder, report, logits, labels)
    return report


def card_lines(r: dict | None, fitted: dict | None = None) -> list[str]:
    """The model card's summary of this run's report (report.json) and calibration (calibration.json): nothing of
    what an earlier run left in the folder."""
    lines = [] if r is None else report_lines(r)
    if fitted and fitted["method"] == "thresholds":
        stored = fitted["thresholds"]
        lines += ["Per-label thresholds (--calibrate thresholds, the best F1 of each label on the validation set) are "
                  "stored in config.json as `label_thresholds`; the recipe's predictions with this model use them: "
                  + ", ".join(f"{n} {t:.3f}" for n, t in stored.items()) + ".", ""]
    elif fitted:
        c = fitted
        lines += [f"Calibrated (--calibrate temperature): the temperature {c['temperature']:.4f}, fitted on "
                  f"{c['fit_examples']} validation examples, is folded into `{c['folded_into']}`, so the "
                  f"probabilities of this model are the calibrated ones; on the other {c['held_out_examples']} "
                  f"examples the ECE went from {c['ece_before']:.4f} to {c['ece_after']:.4f}"
                  + (". The table above is of the model before calibration (accuracy and the argmax are unchanged)."
                     if r is not None else "."), ""]
    return lines


def report_lines(r: dict) -> list[str]:
    """The card's table of a report."""
    head = [f"## Evaluation report ({FOLDER}/, {r['evaluation']}, step {r['step']}, {r['n_examples']} examples)", ""]
    if r["problem_type"] == "regression":
        return [*head, f"MAE {r['mae']:.4f}, RMSE {r['rmse']:.4f}, R^2 {r['r2']:.4f}.", ""]
    per = r.get("per_class") or r["per_label"]
    lines = [*head, f"Macro precision {r['macro']['precision']:.4f}, recall {r['macro']['recall']:.4f}, "
             f"F1 {r['macro']['f1']:.4f}" + (f"; expected calibration error {r['calibration']['ece']:.4f} "
                                              f"({r['calibration']['bins']} bins)" if "calibration" in r else "") + ".",
             "", "| label | precision | recall | F1 | support |", "|---|---|---|---|---|",
             *(f"| {n} | {v['precision']:.4f} | {v['recall']:.4f} | {v['f1']:.4f} | {v['support']} |"
               for n, v in per.items()), ""]
    return lines


def draw(folder: Path, report: dict, logits: torch.Tensor, labels: torch.Tensor) -> None:
    import matplotlib.pyplot as plt

    if report["problem_type"] == "regression":
        pred = logits.float().squeeze(-1).numpy()
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(labels.numpy(), pred, s=8, alpha=0.6)
        low, high = float(min(labels.min(), pred.min())), float(max(labels.max(), pred.max()))
        ax.plot([low, high], [low, high], color="grey", linewidth=1)
        ax.set(xlabel="true", ylabel="predicted", title=f"R^2 {report['r2']:.3f}, RMSE {report['rmse']:.3f}")
        fig.savefig(folder / "scatter.png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.hist(pred - labels.numpy(), bins=30)
        ax.set(xlabel="predicted - true", ylabel="examples", title="residuals")
        fig.savefig(folder / "residuals.png", dpi=120, bbox_inches="tight")
        plt.close(fig)
        return
    if report["problem_type"] == "multi_label":
        return  # per-label 2 x 2 confusions in report.json; one heat map of the labels' counts adds little
    matrix, names = report["confusion_matrix"]["true_by_predicted"], report["confusion_matrix"]["labels"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * len(names), 1 + 0.6 * len(names)))
    ax.imshow(matrix, cmap="Blues")
    ax.set(xticks=range(len(names)), yticks=range(len(names)), xticklabels=names, yticklabels=names,
           xlabel="predicted", ylabel="true", title="confusion matrix")
    top = max(max(row) for row in matrix) or 1
    for i, row in enumerate(matrix):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center", color="white" if count > top / 2 else "black")
    fig.savefig(folder / "confusion_matrix.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    bins = [b for b in report["calibration"]["per_bin"] if b["count"]]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.bar([(b["lower"] + b["upper"]) / 2 for b in bins], [b["accuracy"] for b in bins],
           width=1 / report["calibration"]["bins"], edgecolor="black", alpha=0.7, label="accuracy")
    ax.plot([0, 1], [0, 1], color="grey", linewidth=1, label="calibrated")
    ax.set(xlabel="confidence (top probability)", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1),
           title=f"reliability, ECE {report['calibration']['ece']:.3f}")
    ax.legend()
    fig.savefig(folder / "reliability.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
