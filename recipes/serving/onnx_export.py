"""The ONNX graph of a classifier: torch's own exporter (`torch.onnx.export`, the dynamo path; torch 2.13 needs
onnxscript for it) with the batch and sequence axes dynamic, inputs by the names the tokenizer gives, one output,
`logits`; and ONNX Runtime's dynamic int8 quantization of that graph.

int8 is per channel, one scale per output row of each weight matrix: it keeps more accuracy than ONNX Runtime's default
of one scale per matrix (measured in docs/export.md's results file).
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from pathlib import Path

import torch

from recipes import RecipeError, first_line

GRAPH_LIMIT = 2 * 1024**3  # protobuf's limit on one file: a larger model keeps its weights in model.onnx.data
OUTPUT = "logits"


def input_names(model, tokenizer) -> list[str]:
    """The tokenizer's outputs that the model's forward takes, in the tokenizer's order: the graph's inputs."""
    takes = inspect.signature(model.forward).parameters
    names = [name for name in tokenizer.model_input_names if name in takes]
    if "input_ids" not in names:
        raise RecipeError(f"the model takes none of the tokenizer's inputs as input_ids ({', '.join(names)})")
    return names


def export(model, sample: dict, path: Path) -> None:
    """Write `model`'s graph to `path`, traced on `sample` (a padded batch of 2 rows or more, of 2 tokens or more:
    torch.export would take a size of 1 for a constant)."""
    from torch.export import Dim

    batch, sequence = Dim("batch"), Dim("sequence")
    big = sum(p.numel() * p.element_size() for p in model.parameters()) >= GRAPH_LIMIT
    # torch 2.13's exporter prints each stage, warns that the axes' names are kept and logs the torchvision ops it
    # skips: none of it is the user's business once the parity check has run.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings(), quiet("torch.onnx"):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, (), str(path), kwargs=sample, input_names=list(sample), output_names=[OUTPUT],
                              dynamic_shapes={name: {0: batch, 1: sequence} for name in sample}, dynamo=True,
                              external_data=big)
        except Exception as err:  # torch.export and onnxscript raise many kinds; the first line says which
            raise RecipeError(f"torch.onnx.export cannot export {type(model).__name__}: {first_line(err)}") from None


def quantize_int8(source: Path, target: Path) -> None:
    """ONNX Runtime's dynamic quantization: int8 weights per channel, activations quantized per batch at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet(""):  # onnxruntime 1.32 logs a hint on the root logger meant for static quantization's calibration
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8, per_channel=True)


@contextlib.contextmanager
def quiet(name: str):
    """The logger `name` (the root logger for "") says errors only, while in the block."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
