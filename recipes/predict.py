"""Batch prediction over a file of any size with a trained classifier: PyTorch (one or several processes) or ONNX.

    python recipes/predict.py --model_dir runs/mine --predict_file big.csv --output_dir runs/mine/big
    python recipes/predict.py --model_dir runs/mine/onnx --predict_file big.jsonl --output_dir runs/big  # ONNX Runtime
    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 4 recipes/predict.py \
        --model_dir runs/mine --dataset_name imdb --dataset_split test --output_dir runs/imdb

--model_dir is a run's --output_dir (its final/, PyTorch in fp32), a weights folder, or an export folder of
recipes/export.py (ONNX Runtime; --onnx_file model.int8.onnx for its int8 twin). The rows are read a window at a time
(--window_rows: memory bounded by the window, not the file), sorted by length inside the window, batched, dealt to the
processes, and written to <output_dir>/predictions.jsonl in input order, in the records of the recipe's
--predict_file (recipes/outputs/predict.py). A killed prediction continues where it stopped when the same command runs
again (recipes/serving/output.py). Texts are cut where `pipeline("text-classification", truncation=True)` cuts them,
whose labels these are (--max_length for another length). docs/export.md.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object
from tqdm.auto import tqdm
from transformers import HfArgumentParser

from recipes import RecipeError
from recipes.inputs import problem
from recipes.model import source
from recipes.outputs import predict as recipe_predictions
from recipes.serving import batching, classifier, output, runtime, texts


@dataclass
class PredictConfig:
    model_dir: str = field(metadata={"help": "a run's --output_dir (its final/), a weights folder, or an export "
                                             "folder of recipes/export.py (ONNX Runtime)"})
    output_dir: str = field(metadata={"help": "where predictions.jsonl goes"})
    predict_file: Optional[str] = field(default=None, metadata={"help": "the rows: a .csv, .json or .jsonl file"})
    dataset_name: Optional[str] = field(default=None, metadata={"help": "or the rows of a Hub dataset"})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "the Hub dataset's configuration"})
    dataset_split: str = field(default="test", metadata={"help": "the Hub dataset's split to predict"})
    onnx_file: Optional[str] = field(default=None, metadata={
        "help": "in an export folder: model.onnx (default) or model.int8.onnx"})
    text_column: Optional[str] = field(default=None, metadata={"help": "text column (default: the run's, else text)"})
    text_pair_column: Optional[str] = field(default=None, metadata={"help": "second text column (default: the run's)"})
    label_column: Optional[str] = field(default=None, metadata={
        "help": "a label column, copied into each record where the row has one (default: the run's, else label)"})
    max_length: Optional[int] = field(default=None, metadata={
        "help": "cut texts at N tokens (default: where pipeline(truncation=True) does, the tokenizer's limit)"})
    batch_size: int = field(default=64, metadata={"help": "rows per batch, per process"})
    window_rows: int = field(default=4096, metadata={
        "help": "rows read, tokenized and length-sorted at a time: the memory bound"})
    multi_label_threshold: float = field(default=0.5, metadata={
        "help": "multi-label without stored per-label thresholds: a label is predicted at p >= this"})
    threads: int = field(default=0, metadata={"help": "CPU threads per process (default: cores / processes)"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "replace finished or unfinished predictions in --output_dir"})


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser(PredictConfig, prog="recipes/predict.py", description=__doc__.split("\n\n")[0])
    parser.allow_abbrev = False  # a misspelt flag must fail, not set another
    return parser


def parse_config(argv=None) -> PredictConfig:
    parser = build_parser()
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise RecipeError(f"unknown arguments: {' '.join(unknown)}")
    if bool(cfg.predict_file) == bool(cfg.dataset_name):
        raise RecipeError("give the rows to predict: --predict_file or --dataset_name, one of them")
    if min(cfg.batch_size, cfg.window_rows) < 1 or (cfg.max_length is not None and cfg.max_length < 1):
        raise RecipeError("--batch_size, --window_rows and --max_length must be >= 1")
    return cfg


def binding(cfg: PredictConfig, found, settings: dict, max_length, n_rows: int) -> dict:
    """What an unfinished predictions file is a prediction of: a restart must match it to continue."""
    model_file = found.onnx_file or next(found.folder / f for f in source.WEIGHT_FILES
                                         if (found.folder / f).is_file())
    stat = model_file.stat()
    if cfg.predict_file:
        data = os.stat(cfg.predict_file)
        rows = {"file": str(Path(cfg.predict_file).resolve()), "bytes": data.st_size, "mtime_ns": data.st_mtime_ns}
    else:
        rows = {"dataset": cfg.dataset_name, "config": cfg.dataset_config_name, "split": cfg.dataset_split}
    return {"model": str(model_file.resolve()), "model_bytes": stat.st_size, "model_mtime_ns": stat.st_mtime_ns,
            "rows": {**rows, "count": n_rows}, "text_settings": {**settings, "max_length": max_length},
            "multi_label_threshold": cfg.multi_label_threshold}


def agreed(state: PartialState, compute):
    """`compute()` on the main process, its result (or its error) on every process."""
    result = [None]
    if state.is_main_process:
        try:
            result = [compute()]
        except RecipeError as err:
            result = [err]
    if state.num_processes > 1:
        broadcast_object_list(result)
    if isinstance(result[0], RecipeError):
        raise result[0]
    return result[0]


def records(found, start: int, logits: torch.Tensor, labels: Optional[list], column: str, threshold) -> list[dict]:
    """The recipe's predictions.jsonl lines of rows start, start + 1, ... (with the row's label where it has one)."""
    lines = []
    present = [v for v in labels or [] if not problem.is_missing(v)]
    multi_hot = found.problem_type == "multi_label" and bool(present) and problem.is_multi_hot(present)
    encode = problem.LabelEncoder(found.problem_type, found.names, column, multi_hot)
    for i in range(len(logits)):
        line = problem.prediction_record(found.problem_type, start + i, logits[i], found.names, threshold)
        if labels is not None and not problem.is_missing(labels[i]):
            label = torch.tensor(encode(labels[i], "predict"))
            line["label"] = recipe_predictions.label_value(found.problem_type, label, found.names)
        lines.append(line)
    return lines


def main(cfg: PredictConfig) -> dict:
    # Accelerate 1.15.0 makes a MULTI_GPU launch (ddp.yaml) MULTI_CPU over gloo only with cpu=True; without it every
    # process of a launch on a machine without GPUs would predict the whole file alone.
    state = PartialState(cpu=not torch.cuda.is_available())
    found = classifier.locate(cfg.model_dir, cfg.onnx_file)
    given = {"text_column": cfg.text_column, "text_pair_column": cfg.text_pair_column,
             "label_column": cfg.label_column}
    settings = {**found.text_settings(), **{k: v for k, v in given.items() if v is not None}}
    settings.pop("max_length")
    tokenizer = classifier.load_tokenizer(found.folder)
    max_length = cfg.max_length or found.pipeline_length(tokenizer)
    failure = None
    with state.main_process_first():  # the main process converts the file into datasets' cache, the others read it
        try:  # raised after the context: the main process failing inside it would leave the others at its barrier
            ds = texts.load(cfg.predict_file, cfg.dataset_name, cfg.dataset_config_name, cfg.dataset_split)
        except RecipeError as err:
            failure = err
    if failure:
        raise failure
    texts.check(ds, settings)
    columns = [c for c in (settings["text_column"], settings["text_pair_column"], settings["label_column"])
               if c and c in ds.column_names]
    ds, n = ds.select_columns(columns), len(ds)
    threads = runtime.cpu_threads(cfg.threads)
    if found.onnx_file:
        runner = runtime.OnnxRunner(found.onnx_file, state.device, threads)
        runner.check_inputs(tokenizer)
    else:
        runner = runtime.TorchRunner(found.folder, state.device, threads)
    out, bound = Path(cfg.output_dir), binding(cfg, found, settings, max_length, n)
    start = agreed(state, lambda: output.resume_point(out, bound, cfg.overwrite_output_dir))
    collate = batching.collator(tokenizer, max_length)
    threshold = found.thresholds if found.thresholds is not None else cfg.multi_label_threshold
    writer = output.Writer(out) if state.is_main_process else None
    progress = tqdm(total=n, initial=start, desc="predict", unit="rows", disable=not state.is_main_process)
    began = time.perf_counter()
    for low in range(start, n, cfg.window_rows):
        rows = ds[low:low + cfg.window_rows]
        encodings = texts.encode(tokenizer, rows, settings, max_length)
        local, logits = batching.window_logits(runner, collate, encodings, cfg.batch_size, state.process_index,
                                               state.num_processes)
        parts = gather_object([(local, logits)]) if state.num_processes > 1 else [(local, logits)]
        if state.is_main_process:
            index = torch.cat([part[0] for part in parts])
            logits = torch.cat([part[1] for part in parts if part[1] is not None])[index.argsort()]
            labels = rows.get(settings["label_column"]) if settings["label_column"] else None
            writer.write(records(found, low, logits, labels, settings["label_column"], threshold))
            progress.update(len(logits))
    progress.close()
    seconds = time.perf_counter() - began
    record = {"binding": bound, "rows": n, "continued_from_row": start, "seconds": seconds,
              "rows_per_s": (n - start) / seconds if seconds > 0 else None, "world_size": state.num_processes,
              "runtime": "onnxruntime" if found.onnx_file else "pytorch", "device": str(state.device),
              "threads_per_process": threads, "config": asdict(cfg), "versions": runtime.versions()}
    if state.is_main_process:
        path = writer.finish(record)
        print(f"predicted {n - start} rows" + (f" (rows 0-{start - 1} were written before)" if start else "")
              + f" in {seconds:.1f} s on {state.num_processes} process(es), {record['runtime']}: {path}")
    state.wait_for_everyone()
    return record


if __name__ == "__main__":
    try:
        main(parse_config())
    except RecipeError as err:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # every process fails alike: one line
            tqdm.write(f"error: {err}", file=sys.stderr)
        sys.exit(2)
