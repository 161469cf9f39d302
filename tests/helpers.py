"""Helpers the tests share: run the real recipe in subprocesses, read its records, switch configs to fp32."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.records import read_jsonl
from scripts.bench import free_port

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
TINY = REPO / "artifacts" / "tiny-roberta"
# Small, fast defaults for recipe runs in tests: a few hundred samples, fp32 on CPU, exact eval count 101, one thread
# per process (make test runs two test files at once on 2 cores; one-process and two-process runs then compute with
# the same matmul blocking, as the reference figures in README were measured).
TINY_FLAGS = ["--model_name_or_path", str(TINY), "--max_train_samples", "256", "--max_eval_samples", "101",
              "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "16",
              "--learning_rate", "1e-3", "--ddp_timeout", "120", "--cpu_threads", "1"]

# The parity runs: 8 optimizer steps of 2 x 8 samples, every rank's samples and state recorded. DDP with these flags
# is the one reference that test_strategies (shipped ddp.yaml, parity) and test_tutorials (torchrun, checkpointing)
# compare with: conftest's session fixture `ddp_parity_reference`.
PARITY_FLAGS = ["--max_train_steps", "8", "--per_device_train_batch_size", "8", "--record_ranks"]

__all__ = ["ACCELERATE", "PARITY_FLAGS", "PYTHON", "REPO", "TINY", "TINY_FLAGS", "eval_loader", "fp32_launch_args",
           "free_port", "kill_group", "losses", "no_gpu", "rank_records", "read_jsonl", "run_in_own_group", "run_recipe"]
# For tests whose expectations hold only without GPUs (the CPU rehearsal of FSDP, gloo, the DataParallel fall-back).
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="expects a machine without GPUs (CPU rehearsal)")


def run_recipe(output_dir: Path, *flags: str, config: str | None = "ddp.yaml", launch_args=(), timeout=600,
               check=True, env=None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config> recipes/cls.py ...` (or plain python if None)."""
    if config is None:
        cmd = [PYTHON, "recipes/cls.py"]
    else:
        cmd = [ACCELERATE, "launch", "--config_file", f"accelerate_configs/{config}",
               "--main_process_port", str(free_port()), *launch_args, "recipes/cls.py"]
    cmd += [*TINY_FLAGS, "--output_dir", str(output_dir), *flags]
    proc = run_in_own_group(cmd, timeout, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    return proc


def run_in_own_group(cmd, timeout: float, env=None) -> subprocess.CompletedProcess:
    """subprocess.run in a new session: on timeout the whole process group (launcher and every rank) is killed,
    not only the launcher, so no orphaned rank keeps its port and its cores after a failed test."""
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group that `proc` leads (started with start_new_session=True) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def losses(output_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(output_dir / "metrics.jsonl")]


def rank_records(output_dir: Path) -> list[dict]:
    """Every rank's record, ranks 0..world-1 of the run's run_config.json: missing or extra records fail here, so
    a comparison over them never compares nothing."""
    world = json.loads((Path(output_dir) / "run_config.json").read_text())["world_size"]
    records = [json.loads(p.read_text()) for p in sorted((Path(output_dir) / "ranks").glob("rank*.json"))]
    assert [r["rank"] for r in records] == list(range(world)), f"rank records of {output_dir}: expected {world}"
    return records


def fp32_launch_args(config: str, tmp_path: Path) -> list[str]:
    """The shipped config, switched to fp32: a JSON copy with bf16 off for DeepSpeed, a flag for the others."""
    if config.startswith("zero"):
        ds = json.loads((REPO / "ds_configs" / config.replace(".yaml", ".json")).read_text())
        ds["bf16"]["enabled"] = False
        path = tmp_path / f"fp32_{config}.json"
        path.write_text(json.dumps(ds))
        return ["--deepspeed_config_file", str(path)]
    return ["--mixed_precision", "no"]


def eval_loader(cfg, tokenizer):
    """The recipe's evaluation loader for `cfg`, built in this process as the recipe builds it, and the label names."""
    from recipes import data

    train_ds, eval_ds, names = data.prepare_datasets(cfg, tokenizer)
    return data.build_loaders(cfg, train_ds, eval_ds, tokenizer, world_size=1).eval, names
