"""What computes the logits of a padded batch: the PyTorch model in fp32, or an ONNX file in ONNX Runtime. Both take
the collator's batch (torch tensors by input name) and return float32 logits on the CPU.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from recipes import RecipeError, first_line
from recipes.outputs import records

INSTALL = "pip install 'onnx==1.23.2' 'onnxscript==0.7.2' 'onnxruntime==1.32.0' (or pip install -e '.[export]')"


def cpu_threads(requested: int = 0) -> int:
    """Intra-op threads per process: `requested`, else the cores this process may use / the processes on this machine.
    `accelerate launch` sets OMP_NUM_THREADS=1 in each process (1.15.0), which would leave cores idle: not read."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return requested if requested > 0 else max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def versions() -> dict:
    """The stack's versions and the ONNX packages' (None where one is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found = records.library_versions()
    for name in ("onnx", "onnxscript", "onnxruntime"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def require_onnx(*modules: str) -> None:
    """One line naming the install when an ONNX package is missing."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise RecipeError(f"the ONNX export and runtime need the '{name}' package: {INSTALL}") from None


class TorchRunner:
    """The classifier's PyTorch weights in fp32 (transformers 5 would load them in the file's dtype)."""

    def __init__(self, folder: Path, device: torch.device, threads: int):
        from transformers import AutoModelForSequenceClassification

        if device.type == "cpu":
            torch.set_num_threads(threads)
        try:
            model, info = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32,
                                                                             output_loading_info=True)
        except (OSError, ValueError, RuntimeError) as err:
            raise RecipeError(f"cannot load the classifier in {folder}: {first_line(err)}") from None
        missing = sorted(info["missing_keys"]) + sorted(k for k, *_ in info["mismatched_keys"])
        if missing:  # transformers 5.23 starts such weights at random with a warning: no trained classifier
            raise RecipeError(f"the weights in {folder} lack {len(missing)} of the classifier's tensors "
                              f"({', '.join(missing[:2])}{', ...' if len(missing) > 2 else ''}): not a trained "
                              "classifier")
        self.model, self.device = model.to(device).eval(), device
        self.input_names = _forward_inputs(self.model)

    def __call__(self, batch) -> torch.Tensor:
        with torch.inference_mode():
            inputs = {name: batch[name].to(self.device) for name in batch if name in self.input_names}
            return self.model(**inputs).logits.float().cpu()


class OnnxRunner:
    """An ONNX file in ONNX Runtime; CUDA when this process's device is a GPU and the installed build has it."""

    def __init__(self, path: Path, device: torch.device, threads: int):
        require_onnx("onnxruntime")
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as err:  # onnxruntime raises its own Fail / InvalidGraph / NoSuchFile classes
            raise RecipeError(f"ONNX Runtime cannot load {path}: {first_line(err)}") from None
        self.input_names = {i.name for i in self.session.get_inputs()}

    def check_inputs(self, tokenizer) -> None:
        missing = self.input_names - set(tokenizer.model_input_names)
        if missing:
            raise RecipeError(f"the ONNX graph takes {', '.join(sorted(missing))}, which the tokenizer does not give "
                              f"({', '.join(tokenizer.model_input_names)})")

    def __call__(self, batch) -> torch.Tensor:
        feed = {name: batch[name].numpy().astype("int64") for name in self.input_names}
        return torch.from_numpy(self.session.run(None, feed)[0]).float()


def _forward_inputs(model) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)
