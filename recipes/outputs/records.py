"""Run records: the jsonl files, the resolved run description (run_config.json), versions and device names."""
from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch

from recipes.model import compilation, padding_free

REDACTED = "<redacted>"
SECRET_FLAGS = ("hub_token",)  # never written: run_config.json and the trackers get REDACTED (tracking.py)


def append_jsonl(path: Path, *records: dict) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(record) + "\n" for record in records))


def read_jsonl(path: Path) -> list[dict]:
    """The records of a jsonl file; [] when it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def library_versions() -> dict:
    """Installed versions, read from package metadata: importing DeepSpeed only to read its version costs 4 s."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("accelerate", "deepspeed", "transformers", "datasets"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} cpu ({os.cpu_count()} cores)"


def describe_run(cfg, accelerator, total_steps: int, n_train: int, n_eval: int) -> dict:
    """The resolved configuration written to run_config.json."""
    world = accelerator.num_processes
    return {
        "config": redacted(asdict(cfg)),
        "world_size": world,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "effective_batch_size": cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world,
        "total_optimizer_steps": total_steps,
        "n_train_examples": n_train,
        "n_eval_examples": n_eval,
        "device": device_name(accelerator.device),
        "cpu_threads": torch.get_num_threads(),  # intra-op threads (training/accelerator.py set_cpu_threads)
        "matmul_precision": torch.get_float32_matmul_precision(),  # "high": TF32 (accelerator.use_tf32_matmuls)
        "versions": library_versions(),
        "compile": compilation.describe(cfg, accelerator),  # null: not compiled (recipes/model/compilation.py)
    }


def tracker_config(config: dict) -> dict:
    """TensorBoard hparams take only scalars and strings."""
    return {k: v for k, v in redacted(config).items() if isinstance(v, (int, float, str, bool))}


def redacted(config: dict) -> dict:
    """The config with the value of each secret flag that is set replaced by REDACTED."""
    return {k: REDACTED if k in SECRET_FLAGS and v else v for k, v in config.items()}


class StepLog:
    """The per-step training records (metrics.jsonl, TensorBoard, the progress bar), read from the device in blocks.

    A micro-batch adds its loss sum, token count and padded token count (batch x padded length: the positions the
    model computes) to a tensor on the device; the step's end reduces it over the ranks (one collective, which on
    GPUs the host does not wait for) and keeps the result on the device. Only `flush`, every `every` steps and before
    an evaluation, a checkpoint or the end, copies the kept steps to the host in one `.tolist()`: the loop itself
    never makes the CPU wait for the GPU.

    Two more entries ride on each step's reduction for the ranks' common decisions (recipes/checkpoints/preemption.py): the
    number of ranks whose gradient norm was not finite, and the number that voted to stop (a preemption signal).
    `on_flush` gets them with each record, at the same flush on every rank.
    """

    def __init__(self, accelerator, path: Path, every: int, progress, on_flush=None, tail: bool = False):
        self.accelerator, self.path, self.every, self.progress = accelerator, path, max(1, every), progress
        self.tail = tail  # packed rows end in a filler sequence (--padding_free --pad_to_multiple_of)
        self.window = torch.zeros(3, device=accelerator.device)  # this rank's loss sum, non-pad and padded tokens
        self.pending: list[tuple[dict, torch.Tensor]] = []
        self.on_flush = on_flush

    def add(self, loss_sum: torch.Tensor, batch: dict) -> None:
        tokens, computed = padding_free.token_counts(batch, self.tail)  # padded or packed (--padding_free)
        computed = torch.full((), computed, dtype=torch.float32, device=self.window.device)  # no copy
        self.window += torch.stack([loss_sum.detach().float(), tokens, computed])

    def end_step(self, info: dict, grad_norm: torch.Tensor, stop_vote: float = 0.0) -> None:
        """`info` holds step, epoch, lr, samples (of the step on all ranks), elapsed seconds and, with class weights,
        the window's weight_sum; `stop_vote` 1.0 when this rank asks every rank to stop (the fill of a device tensor
        from a number: no sync)."""
        grad_norm = grad_norm.reshape(1).to(self.window)
        votes = torch.cat([self.window, (~torch.isfinite(grad_norm)).float(), torch.full_like(grad_norm, stop_vote)])
        totals = self.accelerator.reduce(votes, reduction="sum")  # one collective, kept on the device
        self.window.zero_()
        self.pending.append((info, torch.cat([totals, grad_norm])))
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        values = torch.stack([v for _, v in self.pending]).tolist()
        kept, block = [], []
        for (info, _), (loss_total, tokens, padded, bad_grads, votes, grad_norm) in zip(self.pending, values):
            # the window's mean loss (--class_weights: its weighted mean, over the window's weight sum)
            record = {**info, "loss": loss_total / info.get("weight_sum", info["samples"]), "tokens": int(tokens),
                      "padded_tokens": int(padded), "grad_norm": grad_norm}
            self.accelerator.log({"train/loss": record["loss"], "train/lr": info["lr"],
                                  "train/grad_norm": grad_norm}, step=info["step"])
            kept.append(record)
            block.append((record, int(bad_grads), int(votes)))
        if self.accelerator.is_main_process:
            append_jsonl(self.path, *kept)  # one write per flush
        # Shown at the bar's next update: refreshing here would redraw it a second time at every flush.
        self.progress.set_postfix(loss=f"{record['loss']:.4f}", epoch=record["epoch"], refresh=False)
        self.pending.clear()
        if self.on_flush is not None:
            self.on_flush(block)
