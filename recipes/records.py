"""Run records: the jsonl files, the resolved run description (run_config.json), versions and device names."""
from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

import torch


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a jsonl file; [] when it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def library_versions() -> dict:
    import accelerate
    import datasets
    import deepspeed
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for module in (accelerate, deepspeed, transformers, datasets):
        versions[module.__name__] = module.__version__
    return versions


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} cpu ({os.cpu_count()} cores)"


def describe_run(cfg, accelerator, total_steps: int, n_train: int, n_eval: int) -> dict:
    """The resolved configuration written to run_config.json."""
    world = accelerator.num_processes
    return {
        "config": asdict(cfg),
        "world_size": world,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "effective_batch_size": cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world,
        "total_optimizer_steps": total_steps,
        "n_train_examples": n_train,
        "n_eval_examples": n_eval,
        "device": device_name(accelerator.device),
        "versions": library_versions(),
    }


def tracker_config(config: dict) -> dict:
    """TensorBoard hparams take only scalars and strings."""
    return {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}
