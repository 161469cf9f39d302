"""Shared fixtures: the offline tiny model, and a launcher that runs the real recipe in subprocesses."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
TINY = REPO / "artifacts" / "tiny-roberta"
# Small, fast defaults for recipe runs in tests: a few hundred samples, fp32 on CPU, exact eval count 101.
TINY_FLAGS = ["--model_name_or_path", str(TINY), "--max_train_samples", "256", "--max_eval_samples", "101",
              "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "16",
              "--learning_rate", "1e-3", "--ddp_timeout", "120"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The offline model the README builds; built once if this checkout has none yet."""
    if not (TINY / "model.safetensors").exists():
        subprocess.run([PYTHON, "scripts/build_offline_model.py", "--output_dir", str(TINY)], cwd=REPO, check=True)
    return TINY


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(output_dir: Path, *flags: str, config: str | None = "ddp.yaml", launch_args=(), timeout=600,
               check=True, env=None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config> recipes/cls.py ...` (or plain python if None)."""
    if config is None:
        cmd = [PYTHON, "recipes/cls.py"]
    else:
        cmd = [ACCELERATE, "launch", "--config_file", f"accelerate_configs/{config}",
               "--main_process_port", str(free_port()), *launch_args, "recipes/cls.py"]
    cmd += [*TINY_FLAGS, "--output_dir", str(output_dir), *flags]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(output_dir / "metrics.jsonl")]


def rank_records(output_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((output_dir / "ranks").glob("rank*.json"))]
