"""The rows to classify: a CSV or JSON Lines file or a Hub dataset's split, read by `datasets` into a memory-mapped
Arrow table (memory bounded whatever the file's size; `datasets` keeps the table in its cache, so a restart reads it
again in seconds), the text columns checked, and rows tokenized as the recipe tokenizes them.

Text cells: a string; a list of strings (joined with spaces, as recipes/inputs/data.py reads CLUE's keywords); an empty
cell (CSV) or null (JSON), predicted as the empty text, which the model classifies as `pipeline()` does. Anything else
(a number, a mapping) is refused in one line that names the row, before any prediction is written.
"""
from __future__ import annotations

import types
from pathlib import Path
from typing import Optional

from recipes import RecipeError, first_line
from recipes.inputs import data

SCAN_ROWS = 10_000  # rows read at a time when a column of mixed types is checked cell by cell
FORMATS = {".csv": "csv", ".json": "json", ".jsonl": "json"}


def load(predict_file: Optional[str], dataset_name: Optional[str], dataset_config_name: Optional[str],
         split: str):
    """The rows of --predict_file, or of --dataset_name's split, as a `datasets.Dataset` in input order."""
    if predict_file:
        from datasets import load_dataset

        path = Path(predict_file)
        if not path.is_file():
            raise RecipeError(f"data file not found: {path}")
        if path.suffix not in FORMATS:
            raise RecipeError(f"{path}: the rows to predict must be .csv, .json or .jsonl")
        if path.stat().st_size == 0:
            raise RecipeError(f"data file is empty: {path}")
        try:
            return load_dataset(FORMATS[path.suffix], data_files={"predict": str(path)}, split="predict")
        except Exception as err:  # datasets raises ValueError, ArrowInvalid, DatasetGenerationError... on bad files
            raise RecipeError(f"cannot read {path}: {first_line(err)}") from None
    raw = data.load_hub(dataset_name, dataset_config_name)
    if split not in raw:
        raise RecipeError(f"dataset '{dataset_name}' has no split '{split}' (splits: {', '.join(raw)})")
    return raw[split]


def check(ds, settings: dict, what: str = "predict") -> None:
    """The text columns exist and hold text; the data is not empty. A column whose type `datasets` could not settle
    (mixed JSON values) is read cell by cell, SCAN_ROWS at a time."""
    data.check_columns(ds, types.SimpleNamespace(**settings), what, with_label=False)
    for column in filter(None, (settings["text_column"], settings["text_pair_column"])):
        kind = column_kind(ds.features[column])
        if kind == "text":
            continue
        if kind != "mixed":
            raise RecipeError(f"{what} data column '{column}' holds {kind} values, not text")
        for start in range(0, len(ds), SCAN_ROWS):
            for i, value in enumerate(ds[column][start:start + SCAN_ROWS]):
                if not is_text(value):
                    raise RecipeError(f"{what} data row {start + i}: column '{column}' holds {value!r} "
                                      f"({type(value).__name__}), not text")


def column_kind(feature) -> str:
    """text (strings, lists of strings, or only empty cells), mixed (per-row values: datasets' Json feature), or the
    type's name."""
    from datasets import Value

    inner = getattr(feature, "feature", None)  # List, LargeList, Sequence
    if isinstance(feature, Value):
        return "text" if feature.dtype in ("string", "large_string", "null") else feature.dtype
    if isinstance(inner, Value) and inner.dtype in ("string", "large_string"):
        return "text"
    return "mixed" if type(feature).__name__ == "Json" else type(feature).__name__


def is_text(value) -> bool:
    return value is None or isinstance(value, str) or (isinstance(value, list) and
                                                       all(isinstance(v, str) for v in value))


def texts(values: list) -> list[str]:
    """Text cells as the recipe reads them (empty cells as '')."""
    return [data.as_text(v) for v in values]


def encode(tokenizer, rows: dict, settings: dict, max_length: Optional[int]):
    """The rows' token ids (and mask, segment ids): the recipe's tokenizer call (recipes/inputs/data.py
    tokenize_split), cut at `max_length`."""
    first = texts(rows[settings["text_column"]])
    pairs = texts(rows[settings["text_pair_column"]]) if settings["text_pair_column"] else None
    return tokenizer(first, pairs, truncation=settings["truncation"] if max_length else False, max_length=max_length)
