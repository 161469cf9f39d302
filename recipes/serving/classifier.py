"""The classifier a folder holds, for export and prediction, checked before any work.

A folder is one of: a training run's --output_dir (its final/ is the classifier, its run_config.json the run), a
weights folder (final/, best/, any saved AutoModelForSequenceClassification; run_config.json is looked for beside it),
or an export folder (recipes/export.py: model.onnx beside config.json, the tokenizer and export.json, which carries
the run's flags on). config.json gives the problem type, the label names and a multi-label run's per-label thresholds
(recipes/outputs/calibration.py); the run's flags give the text columns, the truncation and the data it was validated
on. Anything else (a missing folder, one without config.json, a model that is not a sequence classifier, weights or
ONNX file missing) is one RecipeError line.
"""
from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from recipes import RecipeError, first_line
from recipes.inputs import problem
from recipes.model import padding_free, source
from recipes.outputs import calibration

RUN_RECORD = "run_config.json"  # written by recipes/cls.py beside final/
EXPORT_RECORD = "export.json"  # written by recipes/export.py in its folder
ONNX_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
WHAT = "give a run's --output_dir, a weights folder such as its final/, or an export folder (recipes/export.py)"
# The text settings prediction and the parity check take from the run, and their values when no run is at hand (the
# recipe's defaults).
TEXT_DEFAULTS = {"text_column": "text", "text_pair_column": None, "label_column": "label",
                 "truncation": "longest_first", "max_length": None}
FROM_HF = {hf: ours for ours, hf in problem.HF_PROBLEM_TYPE.items()}


@dataclass
class Classifier:
    folder: Path  # config.json and the tokenizer
    config: object  # its transformers config
    problem_type: str  # single_label | regression | multi_label
    names: list  # label names, index = logit
    thresholds: Optional[torch.Tensor]  # multi-label: the per-label thresholds config.json stores, else None
    run: Optional[dict]  # the training run's flags (run_config.json "config"), None when not found
    run_dir: Optional[Path]  # the run's folder when one was found (the export's default destination)
    recorded: dict  # text settings on record: the run's flags, or those an export was checked with
    onnx_file: Optional[Path] = None  # ONNX Runtime serves this file; None: the PyTorch weights

    def text_settings(self) -> dict:
        """Columns, truncation and --max_length on record (the recipe's defaults where there is none)."""
        return {key: self.recorded.get(key, default) for key, default in TEXT_DEFAULTS.items()}

    def max_positions(self) -> Optional[int]:
        """The longest input the model takes: its position embeddings less RoBERTa's offset slots."""
        positions = getattr(self.config, "max_position_embeddings", None)
        return positions - padding_free.first_position(self.config) if positions else None

    def pipeline_length(self, tokenizer) -> Optional[int]:
        """Where `pipeline("text-classification", truncation=True)` cuts a text: the tokenizer's model_max_length,
        within the model's positions (a tokenizer without a limit says 1e30)."""
        limits = [n for n in (tokenizer.model_max_length, self.max_positions()) if n and n < 10**9]
        return min(limits) if limits else None


def locate(path: str, onnx_file: Optional[str] = None, need_weights: bool = False) -> Classifier:
    """The classifier `path` holds. `onnx_file`: the ONNX file of an export folder to serve (default model.onnx when
    the folder has one); `need_weights`: the PyTorch weights are wanted (export), an export folder is refused."""
    given = Path(path)
    if not given.exists():
        raise RecipeError(f"{given} not found: {WHAT}")
    if (given / "final" / "config.json").is_file():
        folder, record = given / "final", given / RUN_RECORD
    elif (given / "config.json").is_file():
        folder = given
        record = given / EXPORT_RECORD if (given / EXPORT_RECORD).is_file() else given.parent / RUN_RECORD
    else:
        raise RecipeError(f"{given} holds no classifier (no config.json, nor final/config.json): {WHAT}")
    config = _config(folder)
    if config.problem_type is None:  # a model saved elsewhere: transformers' own rule for its loss
        problem_type = "regression" if config.num_labels == 1 else "single_label"
    elif config.problem_type in FROM_HF:
        problem_type = FROM_HF[config.problem_type]
    else:
        raise RecipeError(f"{folder}/config.json: unknown problem_type '{config.problem_type}'")
    names = [config.id2label[i] for i in range(config.num_labels)]
    thresholds = calibration.label_thresholds(types.SimpleNamespace(problem_type=problem_type, calibrate=None),
                                              None, "", names, config)
    run, run_dir, recorded = _run_record(record)
    found = Classifier(folder, config, problem_type, names, thresholds, run, run_dir, recorded)
    has_onnx = onnx_file is not None or (folder / ONNX_FILE).is_file()
    if need_weights or not has_onnx:
        if has_onnx and not any((folder / f).is_file() for f in source.WEIGHT_FILES):
            raise RecipeError(f"{folder} is an export folder (ONNX, no PyTorch weights): export a run's folder or "
                              "its final/")
        if not any((folder / f).is_file() for f in source.WEIGHT_FILES):
            raise RecipeError(f"{folder} holds a config but no weights ({', '.join(source.WEIGHT_FILES[:2])}, ...)")
        return found
    found.onnx_file = folder / (onnx_file or ONNX_FILE)
    if not found.onnx_file.is_file():
        onnx = sorted(p.name for p in folder.glob("*.onnx"))
        raise RecipeError(f"{found.onnx_file} not found (ONNX files in {folder}: {', '.join(onnx) or 'none'})")
    return found


def load_tokenizer(folder: Path):
    """The tokenizer saved beside the model (recipes/model/source.py: one line when it is missing or empty)."""
    return source.load_tokenizer(types.SimpleNamespace(tokenizer_name=None, model_name_or_path=str(folder),
                                                       revision="main", cache_dir=None, trust_remote_code=False))


def _config(folder: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise RecipeError(f"cannot read {folder}/config.json: {first_line(err)}") from None
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise RecipeError(f"{folder} is not a sequence classifier (architectures: {', '.join(architectures) or 'none'})"
                          f": {WHAT}")
    return config


def _run_record(path: Path) -> tuple[Optional[dict], Optional[Path], dict]:
    """The run's flags from run_config.json (or an export folder's export.json), the run's folder, and the text
    settings on record."""
    if not path.is_file():
        return None, None, {}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RecipeError(f"cannot read {path}: {first_line(err)}") from None
    if path.name == EXPORT_RECORD:
        return record.get("run"), Path(record["run_dir"]) if record.get("run_dir") else None, \
            record.get("text_settings", {})
    return record.get("config"), path.parent, record.get("config", {})
