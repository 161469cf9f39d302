"""Export a trained classifier to ONNX, proven on the run's validation data before it says done.

    python recipes/export.py --run_dir runs/mine         # runs/mine/onnx/: model.onnx, tokenizer, config, export.json
    python recipes/export.py --run_dir runs/mine --int8  # and model.int8.onnx, its scores and speed beside fp32's

The graph comes from torch's own exporter with the batch and sequence axes dynamic (recipes/serving/onnx_export.py).
Before anything is kept, ONNX Runtime's logits are compared with PyTorch's on the validation rows (the run's, read from
its run_config.json, or --validation_file), on one row alone and on rows as long as predictions take: every logit within
1e-4 in fp32 and the same decision wherever it is not a near-tie (recipes/serving/parity.py). A failure is one
`error:` line and nothing in --output_dir. The folder carries what serving needs: config.json (label names, problem
type, a multi-label run's thresholds; a folded temperature is in the weights), the tokenizer, the model card, and
export.json (the parity figures, the run's text settings, versions). `python recipes/predict.py --model_dir
runs/mine/onnx` predicts with it; docs/export.md.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from transformers import HfArgumentParser

from recipes import RecipeError, first_line
from recipes.serving import batching, classifier, onnx_export, parity, runtime, validation


@dataclass
class ExportConfig:
    run_dir: str = field(metadata={"help": "a training run's --output_dir (its final/ is exported), or a weights "
                                           "folder (final/, best/, a saved classifier)"})
    output_dir: Optional[str] = field(default=None, metadata={
        "help": "the export folder (default: <run>/onnx)"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "replace an earlier export in --output_dir"})
    validation_file: Optional[str] = field(default=None, metadata={
        "help": "check on this .csv/.json/.jsonl instead of the run's validation data (when that is not at hand)"})
    text_column: Optional[str] = field(default=None, metadata={"help": "text column (default: the run's)"})
    text_pair_column: Optional[str] = field(default=None, metadata={"help": "second text column (default: the run's)"})
    label_column: Optional[str] = field(default=None, metadata={"help": "label column (default: the run's)"})
    max_length: Optional[int] = field(default=None, metadata={"help": "truncate the check's texts here (default: the "
                                                                      "run's)"})
    max_samples: Optional[int] = field(default=None, metadata={
        "help": "check on the first N validation rows (default: those the run evaluated)"})
    batch_size: int = field(default=32, metadata={"help": "rows per batch of the check"})
    multi_label_threshold: float = field(default=0.5, metadata={
        "help": "multi-label without stored per-label thresholds: a label is predicted at p >= this"})
    int8: bool = field(default=False, metadata={
        "help": "also model.int8.onnx (ONNX Runtime's dynamic quantization): its scores and speed beside fp32's"})
    speed_rounds: int = field(default=3, metadata={"help": "--int8: alternating timed passes of each model"})
    threads: int = field(default=0, metadata={"help": "CPU threads (default: the cores this process may use)"})


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser(ExportConfig, prog="recipes/export.py", description=__doc__.split("\n\n")[0])
    parser.allow_abbrev = False  # a misspelt flag must fail, not set another
    return parser


def parse_config(argv=None) -> ExportConfig:
    parser = build_parser()
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise RecipeError(f"unknown arguments: {' '.join(unknown)}")
    if cfg.batch_size < 1 or cfg.speed_rounds < 1 or (cfg.max_samples is not None and cfg.max_samples < 1):
        raise RecipeError("--batch_size, --speed_rounds and --max_samples must be >= 1")
    return cfg


def destination(cfg: ExportConfig, found) -> Path:
    if cfg.output_dir:
        out = Path(cfg.output_dir)
    elif found.run_dir is not None:
        out = found.run_dir / "onnx"
    else:
        raise RecipeError(f"no run folder around {found.folder} to export into: give --output_dir")
    if out.resolve() == found.folder.resolve():
        raise RecipeError(f"--output_dir {out} is the model's own folder: give another")
    if out.exists() and any(out.iterdir()) and not cfg.overwrite_output_dir:
        raise RecipeError(f"{out} holds an earlier export: --overwrite_output_dir replaces it")
    return out


def trace_sample(rows: validation.Rows, names: list[str], collate) -> dict:
    """Two rows of different lengths among the first 64 (the longest and shortest), padded: a batch with padding."""
    lengths = [len(ids) for ids in rows.encodings["input_ids"][:64]]
    pick = [lengths.index(max(lengths)), lengths.index(min(lengths))]
    if pick[0] == pick[1]:
        pick = [0, min(1, len(lengths) - 1)]
    return dict(collate([{name: rows.encodings[name][i] for name in names} for i in pick]))


def probes(rows: validation.Rows, longest: Optional[int]) -> dict:
    """Shapes the validation batches may not have: one row alone, and two rows as long as predictions cut texts by
    default (the first rows' tokens repeated to that length)."""
    shapes = {"one row": {name: values[:1] for name, values in rows.encodings.items()}}
    if longest:
        shapes[f"2 rows of {longest} tokens"] = {
            name: [(values[i] * (longest // len(values[i]) + 1))[:longest] for i in range(min(2, len(values)))]
            for name, values in rows.encodings.items()}
    return shapes


def check_parity(cfg, found, runners: tuple, rows, collate, threshold, longest, say) -> dict:
    """`runners`: (ONNX Runtime session, PyTorch model) on the same rows, then on the probe shapes."""
    session, torch_model = runners
    reference = batching.logits_in_input_order(torch_model, collate, rows.encodings, cfg.batch_size)
    exported = batching.logits_in_input_order(session, collate, rows.encodings, cfg.batch_size)
    result = {"data": rows.what, "bound": parity.MAX_ABS_DIFFERENCE, "tie_margin": parity.TIE_MARGIN,
              **parity.compare(found.problem_type, reference, exported, threshold)}
    parity.check(result, rows.what)
    result["shapes"] = {}
    for what, encodings in probes(rows, longest).items():
        try:
            expected = batching.logits_in_input_order(torch_model, collate, encodings, 2)
        except (IndexError, RuntimeError) as err:  # a config whose positions or tokenizer limit overstate the model's
            result["shapes"][what] = {"skipped": f"PyTorch fails on it: {first_line(err)}"}
            say(f"warning: the model itself fails on {what} ({first_line(err)}): predict with a smaller --max_length")
            continue
        shape = parity.compare(found.problem_type, expected,
                               batching.logits_in_input_order(session, collate, encodings, 2), threshold)
        parity.check(shape, what)
        result["shapes"][what] = shape
    result["scores"] = {"pytorch": parity.scores(found.problem_type, reference, rows.labels, threshold),
                        "onnx": parity.scores(found.problem_type, exported, rows.labels, threshold)}
    return result


def int8_report(cfg, found, fp32: runtime.OnnxRunner, int8_path: Path, rows, collate, threshold, threads) -> dict:
    """model.int8.onnx against model.onnx on the same rows: scores, decisions that differ, and rows per second in
    alternating passes (medians; this machine's other work shares the figures)."""
    int8 = runtime.OnnxRunner(int8_path, torch.device("cpu"), threads)
    timings = {"fp32": [], "int8": []}
    for _ in range(cfg.speed_rounds):
        for name, session in (("fp32", fp32), ("int8", int8)):
            start = time.perf_counter()
            logits = batching.logits_in_input_order(session, collate, rows.encodings, cfg.batch_size)
            timings[name].append(len(logits) / (time.perf_counter() - start))
            if name == "fp32":
                reference = logits
    quantized = batching.logits_in_input_order(int8, collate, rows.encodings, cfg.batch_size)
    scores = {"fp32": parity.scores(found.problem_type, reference, rows.labels, threshold),
              "int8": parity.scores(found.problem_type, quantized, rows.labels, threshold)}
    speed = {name: statistics.median(values) for name, values in timings.items()}
    report = {"file": int8_path.name, "scores": scores, "rows_per_s": speed, "rows_per_s_rounds": timings,
              "speedup": speed["int8"] / speed["fp32"], "threads": threads, "batch_size": cfg.batch_size,
              "against_fp32": parity.compare(found.problem_type, reference, quantized, threshold)}
    main_score = next(iter(scores["fp32"]), None)
    if main_score:
        report["drop_points"] = 100 * (scores["fp32"][main_score] - scores["int8"][main_score])
        report["score"] = main_score
    return report


def main(cfg: ExportConfig, say=print) -> dict:
    runtime.require_onnx("onnx", "onnxscript", "onnxruntime")
    found = classifier.locate(cfg.run_dir, need_weights=True)
    out = destination(cfg, found)
    given = {"text_column": cfg.text_column, "text_pair_column": cfg.text_pair_column,
             "label_column": cfg.label_column, "max_length": cfg.max_length}
    settings = {**found.text_settings(), **{k: v for k, v in given.items() if v is not None}}
    tokenizer = classifier.load_tokenizer(found.folder)
    threads, cpu = runtime.cpu_threads(cfg.threads), torch.device("cpu")
    torch_model = runtime.TorchRunner(found.folder, cpu, threads)
    max_length = settings["max_length"] or found.pipeline_length(tokenizer)
    rows = validation.load(found, cfg.validation_file, settings, tokenizer, max_length, cfg.max_samples)
    collate = batching.collator(tokenizer, max_length)
    threshold = found.thresholds if found.thresholds is not None else cfg.multi_label_threshold
    names = onnx_export.input_names(torch_model.model, tokenizer)
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # an export killed earlier
    staging.mkdir(parents=True)
    try:
        say(f"exporting {found.folder} ({found.problem_type}, {len(found.names)} outputs, inputs {', '.join(names)})")
        onnx_export.export(torch_model.model, trace_sample(rows, names, collate), staging / classifier.ONNX_FILE)
        session = runtime.OnnxRunner(staging / classifier.ONNX_FILE, cpu, threads)
        checked = check_parity(cfg, found, (session, torch_model), rows, collate, threshold,
                               found.pipeline_length(tokenizer), say)
        say(f"parity on {rows.what}: max |logit difference| {checked['max_abs_logit_difference']:.2e} (bound "
            f"{parity.MAX_ABS_DIFFERENCE:g}), the same decision on every row but {checked['near_ties']} near-tie(s) "
            f"(margin <= {parity.TIE_MARGIN:g}); also on " + ", ".join(k for k, v in checked["shapes"].items()
                                                           if "skipped" not in v))
        record = {"source": str(found.folder), "run_dir": str(found.run_dir) if found.run_dir else None,
                  "run": found.run, "problem_type": found.problem_type, "labels": found.names,
                  "thresholds": dict(zip(found.names, threshold.tolist())) if torch.is_tensor(threshold) else None,
                  "calibration_temperature": getattr(found.config, "calibration_temperature", None),
                  "file": classifier.ONNX_FILE, "inputs": names, "output": onnx_export.OUTPUT,
                  "dynamic_axes": {"batch": 0, "sequence": 1}, "text_settings": {**settings, "max_length": max_length},
                  "parity": checked, "versions": runtime.versions(), "config": asdict(cfg)}
        if cfg.int8:
            onnx_export.quantize_int8(staging / classifier.ONNX_FILE, staging / classifier.INT8_FILE)
            record["int8"] = int8_report(cfg, found, session, staging / classifier.INT8_FILE, rows, collate,
                                         threshold, threads)
            say(int8_line(record["int8"]))
        shutil.copy(found.folder / "config.json", staging / "config.json")
        card = (found.folder / "README.md").read_text() if (found.folder / "README.md").is_file() else ""
        (staging / "README.md").write_text(card.rstrip("\n") + "\n\n" + card_section(record) + "\n")
        tokenizer.save_pretrained(staging)
        (staging / classifier.EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(f"exported to {out / classifier.ONNX_FILE}")
    return record


def card_section(record: dict) -> str:
    """The model card's part on this folder's ONNX file: how to load it and what its check found."""
    checked = record["parity"]
    lines = ["## ONNX", "",
             f"`{record['file']}` is this model exported by recipes/export.py (torch.onnx.export, dynamic batch and "
             f"sequence axes; inputs {', '.join(record['inputs'])}, output `{record['output']}`). On "
             f"{checked['data']}, ONNX Runtime's logits were within {checked['max_abs_logit_difference']:.1e} of "
             f"PyTorch's (bound {checked['bound']:g}) with the same decision on every row but "
             f"{checked['near_ties']} near-tie(s); export.json has the figures.", "", "```python",
             "import onnxruntime as ort", "from transformers import AutoTokenizer", "",
             'tokenizer = AutoTokenizer.from_pretrained(".")  # this folder',
             f'session = ort.InferenceSession("{record["file"]}", providers=["CPUExecutionProvider"])',
             'batch = tokenizer(["a text"], truncation=True, padding=True, return_tensors="np")',
             "logits = session.run(None, {i.name: batch[i.name] for i in session.get_inputs()})[0]", "```"]
    if record["thresholds"]:
        lines += ["", "Multi-label: a label is predicted where sigmoid(logit) >= its threshold in config.json "
                  "(`label_thresholds`)."]
    if record.get("int8"):
        lines += ["", f"`{record['int8']['file']}`: int8 weights (ONNX Runtime's dynamic quantization); "
                  + int8_line(record["int8"]).split(": ", 1)[1] + "."]
    return "\n".join(lines)


def int8_line(report: dict) -> str:
    speed = (f"{report['rows_per_s']['int8']:.0f} rows/s against fp32's {report['rows_per_s']['fp32']:.0f} "
             f"({report['speedup']:.2f} times, {report['threads']} threads)")
    if "score" not in report:
        return f"int8: no labels to score; {report['against_fp32']['decisions_differing']} decisions differ; {speed}"
    name, scores = report["score"], report["scores"]
    line = (f"int8: {name} {scores['int8'][name]:.4f} against fp32's {scores['fp32'][name]:.4f} "
            f"({report['drop_points']:.2f} points lower); {speed}")
    if report["drop_points"] > 0.5:
        line += "; it loses more than 0.5 points: model.onnx (fp32) stays the default"
    return line


def replace(staging: Path, out: Path) -> None:
    """`staging` becomes `out`; an earlier export there is removed once the new one is in place."""
    old = out.parent / f".{out.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    try:
        main(parse_config())
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
