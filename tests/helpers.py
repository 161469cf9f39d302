"""Helpers the tests share: run the real recipe in subprocesses, read its records, switch configs to fp32."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.outputs.records import read_jsonl
from scripts.measure import processes
from scripts.measure.bench import free_port

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
TINY = REPO / "artifacts" / "tiny-roberta"
PRETRAINED = REPO / "artifacts" / "minilm"  # make fetch-pretrained (scripts/fetch_pretrained.py)
SNIPPETS = REPO / "artifacts" / "rotten_tomatoes"
# Small, fast defaults for recipe runs in tests: a few hundred samples, fp32 on CPU, exact eval count 101, one thread
# per process (make test runs two test files at once on 2 cores; one-process and two-process runs then compute with
# the same matmul blocking, as the reference figures in README were measured).
TINY_FLAGS = ["--model_name_or_path", str(TINY), "--max_train_samples", "256", "--max_eval_samples", "101",
              "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "16",
              "--learning_rate", "1e-3", "--ddp_timeout", "120", "--cpu_threads", "1",
              "--eval_report", "false"]  # the report's imports and plots cost each launch seconds: tests/test_report.py

# The parity runs: 8 optimizer steps of 2 x 8 samples, every rank's samples and state recorded. DDP with these flags
# is the one reference that test_strategies (shipped ddp.yaml, parity) and test_tutorials (torchrun, checkpointing)
# compare with: conftest's session fixture `ddp_parity_reference`.
PARITY_FLAGS = ["--max_train_steps", "8", "--per_device_train_batch_size", "8", "--record_ranks"]
# The pretrained encoder's data: the Rotten Tomatoes splits, scored on eval (snippets are 27 tokens on average, 78 at
# most).
PRETRAINED_DATA = ["--train_file", str(SNIPPETS / "train.csv"), "--validation_file", str(SNIPPETS / "eval.csv"),
                   "--text_column", "text", "--label_column", "label", "--max_length", "64"]

__all__ = ["ACCELERATE", "PARITY_FLAGS", "PRETRAINED", "PRETRAINED_DATA", "PYTHON", "REPO", "SNIPPETS", "TINY",
           "TINY_FLAGS", "assert_follows", "assert_pretrained_in_and_out", "committed_results", "eval_loader",
           "fp32_launch_args", "free_port", "kill_group", "launcher", "losses", "no_gpu", "rank_records", "read_jsonl",
           "run_in_own_group", "run_recipe"]
# For tests whose expectations hold only without GPUs (the CPU rehearsal of FSDP, gloo, the DataParallel fall-back).
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="expects a machine without GPUs (CPU rehearsal)")


# What a whole `make test` keeps under the temporary folder at once, at most: 4.0 GB measured on 2026-11-28 (sampled
# every 20 s on a fresh clone), passed tests' folders deleted as they pass (pyproject's tmp_path_retention_policy); the
# bound adds a quarter. A disk that fills mid-run fails tests by the hundred, each with an OSError far from its cause
# (CI, 2026-11-28, 28 minutes in).
TEST_DISK_GB = 5.0


def committed_results(pattern: str = "*.json") -> list[Path]:
    """The files of results/ matching `pattern` that git tracks, in name order: the records the pages quote. A user's
    own `make demo` or `make bench` writes an untracked record beside them, which the docs tests must not read as the
    newest. Outside a git checkout (an unpacked archive), every matching file."""
    found = sorted((REPO / "results").glob(pattern))
    listed = subprocess.run(["git", "ls-files", "-z", "--", "results"], cwd=REPO, capture_output=True)
    if listed.returncode:
        return found
    tracked = {REPO / name for name in listed.stdout.decode().split("\0") if name}
    return [p for p in found if p in tracked]


def disk_problem(folder: Path, need_gb: float | None = None) -> str | None:
    """One line when the disk holding `folder` (or its nearest existing parent) has less than `need_gb` free
    (TEST_DISK_GB unless given)."""
    need_gb = TEST_DISK_GB if need_gb is None else need_gb
    folder = Path(folder)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 2**30
    if free >= need_gb:
        return None
    return (f"make test needs about {need_gb:.0f} GB free under {folder} for its runs' checkpoints; {free:.1f} GB "
            "free: free some, or pass --basetemp DIR on a disk with room")


def tiny_flags(flags) -> list[str]:
    """TINY_FLAGS for a launch with `flags`: a stream has no "first N rows" (the recipe refuses --max_train_samples)."""
    tiny = list(TINY_FLAGS)
    if "--streaming" in flags:
        at = tiny.index("--max_train_samples")
        del tiny[at:at + 2]
    return tiny


def run_recipe(output_dir: Path, *flags: str, config: str | None = "ddp.yaml", launch_args=(), timeout=600,
               check=True, env=None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/<config> recipes/cls.py ...` (or plain python if None).
    Its processes fork from one that imported the stack already when tests/prewarm.py's server runs."""
    if config is None:
        cmd = [python(), "recipes/cls.py"]
    else:
        cmd = [*launcher(), "launch", "--config_file", f"accelerate_configs/{config}",
               "--main_process_port", str(free_port()), *launch_args, "recipes/cls.py"]
    cmd += [*tiny_flags(flags), "--output_dir", str(output_dir), *flags]
    proc = run_in_own_group(cmd, timeout, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-6000:]}")
    return proc


def python() -> str:
    """The interpreter for a python command a test starts: tests/prewarm.py's shim while its server runs (a fork of a
    process that imported the stack, DeepSpeed, PEFT and MLflow not among it), this environment's python otherwise."""
    return os.environ.get("RECIPE_TEST_PREWARM_PYTHON", PYTHON)


def launcher(script: str = ACCELERATE) -> list[str]:
    """The command head that runs a console script of this environment (`accelerate`, `torchrun`): through
    tests/prewarm.py's shim while its server runs, so the launch and its ranks fork from a process with the stack
    imported; the script itself otherwise."""
    python = os.environ.get("RECIPE_TEST_PREWARM_PYTHON")
    return [python, script] if python else [script]


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
    """SIGKILL the launch `proc` leads (started with start_new_session=True), its ranks included, and reap it."""
    processes.kill_launch(proc)


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
    from recipes.inputs import data

    train_ds, eval_ds, names = data.prepare_datasets(cfg, tokenizer)
    return data.build_loaders(cfg, train_ds, eval_ds, tokenizer, world_size=1).eval, names


def assert_pretrained_in_and_out(out: Path, folder: Path, dtype=torch.float32) -> None:
    """A run of the pretrained encoder (a BertModel file: keys without the `bert.` prefix) started from the file's
    tensors, each under the model's name for it, in the dtype the strategy holds weights in (rank 0's record, gathered
    where sharded), and its final/ holds the model's own names (never LayerNorm.gamma, nor the file's unprefixed
    ones) and loads back with nothing missing or left over. The file's `embeddings.position_ids` is a buffer that
    transformers 5.23 keeps out of the state dict."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from recipes.testing.probe import fingerprint

    files = {k: v for k, v in load_file(folder / "model.safetensors").items() if k != "embeddings.position_ids"}
    own = {f"bert.{key}" for key in files} | {"classifier.weight", "classifier.bias"}
    start = rank_records(out)[0]["start_weights"]
    assert set(start) == own, set(start) ^ own
    for key, tensor in files.items():
        assert start[f"bert.{key}"]["sha256"] == fingerprint(tensor.to(dtype))["sha256"], key
    assert set(load_file(out / "final" / "model.safetensors")) == own
    model, info = AutoModelForSequenceClassification.from_pretrained(out / "final", output_loading_info=True)
    assert not any(info.values()), info
    assert set(model.state_dict()) == own


def assert_follows(ref: Path, got: Path, atol: float, grad_norm_rtol: float, label: str, steps: int = 8) -> float:
    """Run `got` followed run `ref` step by step: per-step losses within `atol`, pre-clip gradient norms within
    `grad_norm_rtol` relative, the same last eval accuracy; prints and returns the largest loss difference."""
    a, b = losses(ref), losses(got)
    assert len(a) == len(b) == steps
    delta = max(abs(x - y) for x, y in zip(a, b))
    print(f"{label}: max |loss - reference loss| over {steps} steps = {delta:.3e}")
    assert delta <= atol, (a, b)
    norms = [[s["grad_norm"] for s in read_jsonl(out / "metrics.jsonl")] for out in (ref, got)]
    print(f"{label}: grad norms {norms[1]} vs reference {norms[0]}")
    assert norms[1] == pytest.approx(norms[0], rel=grad_norm_rtol, abs=0)
    assert read_jsonl(got / "eval.jsonl")[-1]["accuracy"] == read_jsonl(ref / "eval.jsonl")[-1]["accuracy"]
    return delta
