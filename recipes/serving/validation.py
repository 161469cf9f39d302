"""The labelled rows an export is checked on: the run's validation data as the run evaluated it (its flags in
run_config.json: the same files, Hub dataset or offline split, the same --max_eval_samples, columns, truncation and
--max_length), or a file given on the command line when that data is not at hand."""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

import torch

from recipes import RecipeError
from recipes.inputs import data, problem
from recipes.serving import texts


@dataclass
class Rows:
    what: str  # where the rows come from, for messages and records
    encodings: dict  # input name -> token lists, in row order
    labels: torch.Tensor  # encoded as the recipe encodes them (missing: -1 / nan)


def load(found, validation_file: Optional[str], settings: dict, tokenizer, max_length: int,
         limit: Optional[int]) -> Rows:
    run = dict(found.run or {})
    # with_predict (and nothing to predict): load_raw_splits then keeps quiet about the offline default data
    cfg = types.SimpleNamespace(**{**run, **settings, "max_length": max_length, "predict_file": None,
                                   "do_predict": False})
    if validation_file:
        raw = texts.load(validation_file, None, None, "")
        texts.check(raw, settings, "validation")
        encode_label, what = file_labels(found, raw, settings["label_column"]), validation_file
    else:
        if found.run is None:
            raise RecipeError(f"no {found.folder.parent}/run_config.json to find the run's validation data: give "
                              "--validation_file")
        try:
            train, raw, _ = data.load_raw_splits(cfg, with_predict=True)
            texts.check(raw, settings, "validation")
            names, encode_label = data.label_space(train, raw, cfg)
        except RecipeError as err:
            raise RecipeError(f"the run's validation data: {err}; give --validation_file") from None
        if names != found.names:
            raise RecipeError(f"the run's data has labels {names}, {found.folder} has {found.names}: give "
                              "--validation_file")
        what = f"the run's validation data ({describe(run)})"
        limit = limit or run.get("max_eval_samples")
    rows = data.tokenize_split(raw, cfg, tokenizer, encode_label, "validation", limit)
    names = [name for name in tokenizer.model_input_names if name in rows.column_names]
    return Rows(f"{len(rows)} rows of {what}", {name: rows[name][:] for name in names},
                torch.tensor(rows["labels"][:]))


def file_labels(found, raw, column: str) -> problem.LabelEncoder:
    """The label encoder of a file's labels against the model's names (labels absent: every row unlabelled)."""
    present = [v for v in raw[column][:] if not problem.is_missing(v)] if column in raw.column_names else []
    multi_hot = found.problem_type == "multi_label" and bool(present) and problem.is_multi_hot(present)
    return problem.LabelEncoder(found.problem_type, found.names, column, multi_hot)


def describe(run: dict) -> str:
    if run.get("validation_file"):
        return run["validation_file"]
    if run.get("dataset_name"):
        return f"{run['dataset_name']} {run.get('validation_split_name') or 'validation'}"
    return f"{run.get('train_file') or 'the offline reviews'} split {run.get('validation_split')} by seed " \
        f"{run.get('seed')}"
