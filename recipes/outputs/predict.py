"""Predictions after training: predictions.jsonl, every input row exactly once and in input order, on any world size.

The rows go through a DataLoader prepared by Accelerate (in input order, or longest first with --group_by_length):
rank r gets batches r, r + world, ..., and `gather_for_metrics` concatenates one batch per rank per call and drops
the samples Accelerate repeats to complete the last round. The row index travels with each example, the gathered
rows are put back in input order by it and each line is written from it: the order is restored, not assumed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from recipes.inputs import data, problem


def write_predictions(cfg, accelerator, model, predict_ds, tokenizer, names: list[str], path: Path,
                      thresholds: torch.Tensor | None = None) -> int:
    """Predict every row of `predict_ds` and write `path` (rank 0, through a temporary file); returns the count.
    Multi-label: a label is predicted at p >= its own threshold (`thresholds`, recipes/outputs/calibration.py), else at
    --multi_label_threshold.

    Each line: {"row", "prediction" (label name, list of names, or score), "probabilities" (classification),
    "label" (the row's own label when it has one)}.
    """
    loader = torch.utils.data.DataLoader(predict_ds, batch_size=cfg.per_device_eval_batch_size,
                                         sampler=data.longest_first(predict_ds, cfg),
                                         collate_fn=data.collator(cfg, tokenizer))
    loader = accelerator.prepare(loader)
    model.eval()
    rows, logits_all, labels_all = [], [], []
    for batch in loader:
        row, labels = batch.pop(data.ROW), batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits.float()
        row, logits, labels = accelerator.gather_for_metrics((row, logits, labels))
        rows.append(row.cpu())
        logits_all.append(logits.cpu())
        labels_all.append(labels.cpu())
    model.train()
    rows, logits, labels = torch.cat(rows), torch.cat(logits_all), torch.cat(labels_all)
    order = rows.argsort()  # input order: the rows came longest first with --group_by_length
    rows, logits, labels = rows[order], logits[order], labels[order]
    has_label = problem.scored(cfg.problem_type, labels)
    if accelerator.is_main_process:
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            for i in range(len(rows)):
                record = problem.prediction_record(cfg.problem_type, int(rows[i]), logits[i], names,
                                                   cfg.multi_label_threshold if thresholds is None else thresholds)
                if has_label[i]:
                    record["label"] = label_value(cfg.problem_type, labels[i], names)
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    accelerator.wait_for_everyone()
    return len(rows)


def label_value(problem_type: str, label: torch.Tensor, names: list[str]):
    if problem_type == "regression":
        return float(label)
    if problem_type == "multi_label":
        return [n for n, hot in zip(names, label.tolist()) if hot > 0]
    return names[int(label)]
