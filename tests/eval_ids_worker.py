"""Launched by tests/test_strength.py with `accelerate launch` on 2 processes; not a test module itself.

Runs the recipe's own `evaluate` on eval sets whose labels are the example indices 0..n-1, and records the
references that `evaluate` handed to the metrics: after gathering over the ranks they must be every index once.
Each set is evaluated in input order (key "N") and with --group_by_length's longest-first batches (key "N:grouped").
Usage: eval_ids_worker.py MODEL_DIR OUT_DIR N [N ...]; rank 0 writes OUT_DIR/eval_ids.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from recipes import cls
from recipes.inputs import data
from recipes.metrics import compute_metrics, load_metrics
from recipes.training import accelerator as setup


def main(model_dir: str, out: str, sizes: list[int]) -> None:
    cfg = cls.parse_config(["--model_name_or_path", model_dir, "--max_train_samples", "64",
                            "--per_device_eval_batch_size", "16", "--output_dir", out])
    accelerator = setup.make_accelerator(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = accelerator.prepare(AutoModelForSequenceClassification.from_pretrained(model_dir))
    seen = []

    def record_references(metrics, predictions, references):  # what evaluate() computed its metrics on
        seen.append(references.tolist())
        return compute_metrics(metrics, predictions, references)

    cls.compute_metrics = record_references
    # The labels are example indices here, not classes: the evaluation's mean loss means nothing for them.
    cls.problem.loss_sum = lambda problem_type, logits, labels: torch.zeros(())
    metrics = load_metrics()
    found = {}
    for n in sizes:
        cfg.max_eval_samples = n
        with accelerator.main_process_first():
            train_ds, eval_ds, _ = data.prepare_datasets(cfg, tokenizer)
            eval_ds = eval_ds.map(lambda row, i: {"labels": i}, with_indices=True)
        for grouped in (False, True):
            cfg.group_by_length = grouped
            eval_dl = accelerator.prepare(data.build_loaders(cfg, train_ds, eval_ds, tokenizer,
                                                             accelerator.num_processes).eval)
            seen.clear()
            result = cls.evaluate(model, eval_dl, accelerator, metrics)
            found[f"{n}:grouped" if grouped else str(n)] = {"ids": seen[0], "n_examples": result["n_examples"],
                                                             "world": accelerator.num_processes}
    if accelerator.is_main_process:
        Path(out, "eval_ids.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3:]])
