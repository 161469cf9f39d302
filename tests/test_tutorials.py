"""Issue 12, everything the tutorials teach: ZeRO-1, fp16, activation checkpointing, torchrun, a Trainer script with
our DeepSpeed JSONs, ZeRO across machines, the Chinese README.

Fast tier (in-process, no launch): fp16 twins equal their generator's output, the bf16-capability check on a
mocked pre-Ampere GPU, the fp16 configs' resolution (CPU refuses fp16: see test_fp16_on_cpu_is_refused_or_inert),
the Trainer-arguments check, the two activation-checkpointing switches refused together, activation memory on the
tiny shape, the ZeRO-1 memory model, README_zh.md's commands.
Multi-process tier: one fp32 DDP reference run shared by ZeRO-1 parity, torchrun and gradient checkpointing; a
Trainer + ZeRO-2 run on 2 processes; zero2_multinode.yaml as two "machines" on loopback.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from helpers import (PARITY_FLAGS, PYTHON, REPO, TINY_FLAGS, fp32_launch_args, free_port, launcher, losses,
                     rank_records, read_jsonl, run_recipe)
from recipes import RecipeError
from recipes.checks import trainer_args_checks
from recipes.model import activation_checkpointing
from scripts import check_config, make_fp16_configs
from scripts.measure import activation_memory
from scripts import memory_model as mm

TORCHRUN = str(Path(PYTHON).parent / "torchrun")
# DeepSpeed's dynamic loss scaler as the fp16 twins configure it: start at 2^16, halve after 2 overflows (hysteresis),
# double after 1000 clean steps, never below 1.
DYNAMIC_SCALE_ARGS = {"init_scale": 2**16, "scale_window": 1000, "delayed_shift": 2, "consecutive_hysteresis": False,
                      "min_scale": 1}


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # deepspeed_config_file paths are relative to the launch directory


# fp16 ---------------------------------------------------------------------------------------------------------

def test_fp16_twins_equal_the_generator_output():
    """Each bf16 DeepSpeed JSON has its fp16 twin, byte for byte what scripts/make_fp16_configs.py writes from it
    (after the bf16 JSONs change, rerun the script)."""
    sources = make_fp16_configs.bf16_sources()
    assert [p.stem for p in sources] == ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
    for source in sources:
        bf16 = json.loads(source.read_text())
        twin_text = make_fp16_configs.twin_path(source).read_text()
        assert twin_text == make_fp16_configs.render(make_fp16_configs.fp16_twin(bf16)), source.name
        twin = json.loads(twin_text)
        assert "bf16" not in twin and "data_types" not in twin
        assert twin["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                                "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
        assert {k: v for k, v in twin.items() if k != "fp16"} == \
            {k: v for k, v in bf16.items() if k not in ("bf16", "data_types")}
    assert make_fp16_configs.main(["--check"]) == 0


def _fake_gpu(monkeypatch, capability, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize("yaml_path, fix", [
    ("accelerate_configs/zero2.yaml", "use ds_configs/zero2_fp16.json (--deepspeed_config_file)"),
    ("accelerate_configs/zero1.yaml", "use ds_configs/zero1_fp16.json (--deepspeed_config_file)"),
    ("accelerate_configs/fsdp.yaml", "use --mixed_precision fp16 on the launch line"),
])
def test_bf16_refused_on_a_gpu_without_bf16(monkeypatch, yaml_path, fix):
    _fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    assert check_config.check_yaml(yaml_path, {}) == [
        f"bf16 asked for but Tesla T4 (compute capability 7.5) has no bf16 (needs 8.0 or newer): {fix}"]
    _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100")
    assert check_config.check_yaml(yaml_path, {}) == []


def test_bf16_check_inside_the_launch(monkeypatch):
    """The recipe's start-up check sees the same from the launch environment; the fp16 twin and fp32 DDP pass."""
    _fake_gpu(monkeypatch, (7, 0), "Tesla V100")
    ds_env = {"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no"}
    zero3 = {**ds_env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero3.json"}
    problems = check_config.check_launch_env(zero3, {})
    assert problems == ["bf16 asked for but Tesla V100 (compute capability 7.0) has no bf16 (needs 8.0 or newer): "
                        "use ds_configs/zero3_fp16.json (--deepspeed_config_file)"]
    assert check_config.check_launch_env({**ds_env, "ACCELERATE_DEEPSPEED_CONFIG_FILE":
                                          "ds_configs/zero3_fp16.json"}, {}) == []
    assert check_config.check_launch_env({"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "fp16"}, {}) == []
    assert len(check_config.check_launch_env({"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "bf16"}, {})) == 1


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
def test_fp16_twin_resolves(tmp_path, name):
    """An fp16 twin passes the checker in place of its bf16 JSON, and DeepSpeed's own config parser, given the
    values Accelerate fills for the "auto"s (micro-batch 8, accumulation 2; one process, as no process group is
    initialised here), reads dynamic loss
    scaling starting at 2^16, with fp16 and not bf16."""
    from deepspeed.runtime.config import DeepSpeedConfig

    twin = f"ds_configs/{name}_fp16.json"
    launch = yaml.safe_load((REPO / "accelerate_configs" / f"{name}.yaml").read_text())
    launch["deepspeed_config"]["deepspeed_config_file"] = twin
    path = tmp_path / f"{name}_fp16.yaml"
    path.write_text(yaml.safe_dump(launch))
    flags = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}
    assert check_config.check_yaml(str(path), flags) == []
    config = json.loads((REPO / twin).read_text())
    filled = {**config, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
              "train_batch_size": 16, "gradient_clipping": 1.0}
    ds = DeepSpeedConfig(filled, mpu=None)
    fp16 = ds.float16_config
    assert (fp16.enabled, ds.bfloat16_config.enabled) == (True, False)
    assert fp16.loss_scale == 0 and fp16.initial_dynamic_scale() == 2**16  # loss_scale 0 = dynamic
    assert fp16.dynamic_loss_scale_args() == DYNAMIC_SCALE_ARGS
    assert ds.zero_optimization_stage == int(name[4])


def test_fp16_on_cpu_is_refused_or_inert():
    """What the libraries do with fp16 on CPU, pinned so the README's lines stay true: Accelerate 1.15.0 enables
    fp16 autocast and its grad scaler only for `device.type != "cpu"` (Accelerator.__init__), so a CPU run with
    --mixed_precision fp16 computes in fp32; DeepSpeed 0.19.8 refuses it ("Type fp16 is not supported on your
    device.", DeepSpeedEngine._do_sanity_check) unless the CPU has mkldnn fp16."""
    from accelerate import Accelerator
    from deepspeed.accelerator import get_accelerator

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # other in-process tests leave an fp32 state behind
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="fp16")
        model = accelerator.prepare(torch.nn.Linear(4, 4))
        assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None
        assert model(torch.randn(2, 4)).dtype == torch.float32
    finally:  # the state is a process-wide singleton: leave none behind for other in-process tests
        AcceleratorState._reset_state(reset_partial_state=True)
    # CPU_Accelerator.is_fp16_supported returns a falsy None when mkldnn has no fp16, which the engine refuses.
    assert bool(get_accelerator().is_fp16_supported()) == bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# Trainer arguments vs a launch config -------------------------------------------------------------------------

def test_trainer_args_disagreements_are_named(tmp_path):
    zero2 = yaml.safe_load((REPO / "accelerate_configs" / "zero2.yaml").read_text())
    good = {"deepspeed": "ds_configs/zero2.json", "bf16": True, "fp16": False, "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1, "max_grad_norm": 1.0}
    assert trainer_args_checks.trainer_args_problems(good, zero2) == []
    bad = {**good, "deepspeed": "ds_configs/zero3.json", "bf16": False, "fp16": True}
    assert trainer_args_checks.trainer_args_problems(bad, zero2) == [
        "trainer args: deepspeed=ds_configs/zero3.json but the YAML names ds_configs/zero2.json",
        "trainer args: precision fp16 (bf16/fp16 arguments) but ds_configs/zero2.json says bf16"]
    assert trainer_args_checks.trainer_args_problems({**good, "deepspeed": None}, zero2) == [
        "trainer args: deepspeed is not set but the YAML launches DeepSpeed with ds_configs/zero2.json; "
        "pass deepspeed=ds_configs/zero2.json"]
    ddp = yaml.safe_load((REPO / "accelerate_configs" / "ddp.yaml").read_text())
    assert trainer_args_checks.trainer_args_problems(good, ddp) == [
        "trainer args: deepspeed=ds_configs/zero2.json but the YAML's distributed_type is MULTI_GPU",
        "trainer args: precision bf16 (bf16/fp16 arguments) but the YAML's mixed_precision is no"]
    fixed = tmp_path / "micro16.json"
    fixed.write_text(json.dumps({**json.loads((REPO / "ds_configs/zero2.json").read_text()),
                                 "train_micro_batch_size_per_gpu": 16}))
    launch = {**zero2, "deepspeed_config": {"deepspeed_config_file": str(fixed)}}
    assert trainer_args_checks.trainer_args_problems({**good, "deepspeed": str(fixed)}, launch) == [
        f"trainer args: per_device_train_batch_size=8 but {fixed} has train_micro_batch_size_per_gpu=16"]


# Activation checkpointing --------------------------------------------------------------------------------------

def test_gradient_checkpointing_and_fsdp_checkpointing_are_exclusive(tiny_model):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny_model))
    fsdp_ac = {"ACCELERATE_USE_FSDP": "true", "FSDP_ACTIVATION_CHECKPOINTING": "true"}
    with pytest.raises(RecipeError, match="--gradient_checkpointing and fsdp_activation_checkpointing: true"):
        activation_checkpointing.apply(model, True, fsdp_ac)
    assert not model.is_activation_checkpointing
    activation_checkpointing.apply(model, False, fsdp_ac)  # FSDP's own, alone: fine
    activation_checkpointing.apply(model, True, {"ACCELERATE_USE_FSDP": "true"})
    assert model.is_activation_checkpointing


def test_activation_memory_shrinks_with_checkpointing(tiny_model):
    """On the tiny shape (2 layers), batch 16 x 64: fewer live activation bytes after forward, same loss.
    scripts/measure/activation_memory.py gives the roberta-base numbers of the README the same way."""
    off = activation_memory.measure(str(tiny_model), 16, 64, checkpointing=False)
    on = activation_memory.measure(str(tiny_model), 16, 64, checkpointing=True)
    print(f"tiny 16x64 activations: {off['activations']} B without, {on['activations']} B with")
    assert on["activations"] < 0.5 * off["activations"]
    assert on["loss"] == off["loss"]


# Memory model: ZeRO-1 -------------------------------------------------------------------------------------------

def test_memory_model_zero1():
    P, N = 1_000_000, 4
    shape = mm.ModelShape(num_params=P, hidden_size=256)
    bucket = 20_000_000  # zero1.json's reduce_bucket_size, in elements
    fp32 = mm.totals(mm.predict("zero1", shape, N, "fp32"))
    assert fp32["resident"] == 4 * P + 12 * P // N  # whole fp32 module, sharded master + moments
    assert fp32["peak"] == 4 * P + 12 * P // N + 4 * P + 2 * bucket * 4  # + whole gradients + 2 buckets
    # As shipped, bf16 without fp32 accumulation: DeepSpeedZeroOptimizer, bf16 module, sharded master + moments;
    # around the step the whole bf16 gradients, the fp32 copy of the partition and 2 bf16 buckets.
    bf16 = mm.totals(mm.predict("zero1", shape, N, "bf16"))
    assert bf16["resident"] == 2 * P + 12 * P // N
    assert bf16["peak"] == 2 * P + 12 * P // N + 2 * P + 4 * P // N + 2 * bucket * 2
    # With "data_types": {"grad_accum_dtype": "fp32"} DeepSpeed uses BF16_Optimizer: a whole fp32 gradient buffer.
    ds = {**mm.load_ds_config("zero1"), "data_types": {"grad_accum_dtype": "fp32"}}
    bf16_acc = mm.totals(mm.predict("zero1", shape, N, "bf16", ds_config=ds))
    assert bf16_acc["resident"] == bf16_acc["peak"] == 2 * P + 4 * P + 12 * P // N


# README_zh.md ----------------------------------------------------------------------------------------------------

FIGURE = re.compile(r"(?<![\w.])\d[\d,]*\.\d+(?:\.\d+)*x?")  # 0.8873, 3,513 is not one: 35,123.5 would be


def command_blocks(text: str, table_header: str) -> dict:
    """Every fenced block's commands and the strategy table's commands, comments dropped; the figures of the prose
    (decimals, ratios, versions), sorted: the languages order a sentence differently."""
    fenced = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [[line.split("#")[0].rstrip() for line in block.splitlines() if line.split("#")[0].strip()]
                for block in fenced]
    table = text.split(table_header, 1)[1].split("\n\n", 1)[0]
    strategies = [re.findall(r"`([^`]+)`", row.split("|")[2]) for row in table.splitlines()[2:]]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`]*`", "", prose)  # commands and paths are compared above
    return {"commands": commands, "strategies": strategies, "figures": sorted(FIGURE.findall(prose)),
            "thousands": sorted(re.findall(r"\d{1,3}(?:,\d{3})+", prose)), "links": sorted(set(re.findall(
                r"\]\(([^)]+)\)", text)) - {"README.md", "README_zh.md"})}


def test_readme_zh_commands_match_readme():
    """README_zh.md has README.md's sections in Chinese: the same commands, table commands, figures and links."""
    en = command_blocks((REPO / "README.md").read_text(), "| strategy | command |")
    zh = command_blocks((REPO / "README_zh.md").read_text(), "| 策略 | 命令 |")
    assert zh == en
    assert any("zero1.yaml" in c for row in en["strategies"] for c in row)
    assert any(c.startswith("torchrun") for row in en["strategies"] for c in row)
    # the benchmark ratios themselves are checked against the latest results file in tests/test_docs.py
    assert "0.8873" in en["figures"] and any(f.endswith("x") for f in en["figures"]) and "35,123" in en["thousands"]
    assert any("--resume_from_checkpoint auto" in line for block in en["commands"] for line in block)


# Multi-process: ZeRO-1, torchrun, gradient checkpointing vs one DDP reference ---------------------------------


def _compare(ref: Path, got: Path, atol: float) -> float:
    a, b = losses(ref), losses(got)
    assert len(a) == len(b) == 8
    delta = max(abs(x - y) for x, y in zip(a, b))
    assert delta <= atol, (a, b)
    assert [r["sample_ids"] for r in rank_records(got)] == [r["sample_ids"] for r in rank_records(ref)]
    return delta


# ZeRO-1's fp32 parity with DDP (losses and gradient norms) is in test_strategies.py with ZeRO-2/3 and FSDP2.


@pytest.mark.multiproc
def test_torchrun_trains_like_accelerate_launch(ddp_parity_reference, tmp_path):
    """`torchrun --nproc_per_node 2 recipes/cls.py` (no accelerate config: MULTI_CPU over gloo from the
    environment torchrun sets) runs the same code path as ddp.yaml: identical per-step losses."""
    cmd = [*launcher(TORCHRUN), "--nproc_per_node", "2", "--master_port", str(free_port()), "recipes/cls.py",
           *TINY_FLAGS, *PARITY_FLAGS, "--output_dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resolved = json.loads((tmp_path / "run_config.json").read_text())
    assert resolved["world_size"] == 2 and resolved["distributed_type"] == "MULTI_CPU"
    assert _compare(ddp_parity_reference, tmp_path, 0.0) == 0.0


@pytest.mark.multiproc
def test_gradient_checkpointing_keeps_the_losses(ddp_parity_reference, tmp_path):
    """DDP with --gradient_checkpointing against the same run without, fp32, dropout on: the recomputed forward
    restores the RNG state (non-reentrant checkpoint), so the gradients and thus every loss are the same; the
    tolerance allows only float reordering in the recomputation (measured: 0)."""
    run_recipe(tmp_path, *PARITY_FLAGS, "--gradient_checkpointing", config="ddp.yaml")
    delta = _compare(ddp_parity_reference, tmp_path, 1e-6)
    print(f"gradient checkpointing: max |loss - loss without| over 8 steps = {delta:.3e}")


# Multi-process: Trainer + our ZeRO-2 JSON, ZeRO-2 across two "machines" ----------------------------------------

@pytest.mark.multiproc
def test_trainer_runs_zero2_with_our_json(tiny_model, tmp_path):
    """scripts/trainer_deepspeed.py: transformers.Trainer, TrainingArguments(deepspeed=<our zero2 JSON, fp32>,
    ddp_backend="gloo") on 2 CPU processes, 3 steps. Every "auto" is resolved; the checker passes the arguments
    against a YAML naming the same JSON and names the disagreements against the shipped bf16 zero2.yaml."""
    launch = fp32_launch_args("zero2.yaml", tmp_path)
    ds_path = launch[1]
    out = tmp_path / "run"
    cmd = [*launcher(TORCHRUN), "--nproc_per_node", "2", "--master_port", str(free_port()),
           "scripts/trainer_deepspeed.py",
           "--deepspeed", ds_path, "--ddp_backend", "gloo", "--use_cpu", "--model_name_or_path", str(tiny_model),
           "--max_train_samples", "64", "--max_eval_samples", "32", "--per_device_train_batch_size", "8",
           "--max_steps", "3", "--logging_steps", "1", "--learning_rate", "1e-3", "--report_to", "none",
           "--save_strategy", "no", "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resolved = json.loads((out / "ds_config_resolved.json").read_text())
    assert "auto" not in json.dumps(resolved)
    assert (resolved["train_micro_batch_size_per_gpu"], resolved["train_batch_size"]) == (8, 16)
    assert resolved["zero_optimization"]["stage"] == 2 and resolved["gradient_clipping"] == 1.0
    logged = [r["loss"] for r in read_jsonl(out / "trainer_log.jsonl") if "loss" in r]
    assert len(logged) == 3 and all(0 < x < 10 for x in logged)
    same = yaml.safe_load((REPO / "accelerate_configs" / "zero2.yaml").read_text())
    same["deepspeed_config"]["deepspeed_config_file"] = ds_path
    (tmp_path / "same.yaml").write_text(yaml.safe_dump(same))
    args = str(out / "training_args.json")
    assert check_config.trainer_problems(args, str(tmp_path / "same.yaml")) == []
    assert check_config.trainer_problems(args, "accelerate_configs/zero2.yaml") == [
        f"{args}: deepspeed={ds_path} but the YAML names ds_configs/zero2.json",
        f"{args}: precision no (bf16/fp16 arguments) but ds_configs/zero2.json says bf16"]


@pytest.mark.multiproc
def test_zero2_multinode_runs_as_two_machines(tiny_model, tmp_path):
    """Two launches of zero2_multinode.yaml on this host (machine ranks 0 and 1, one process each, machine 0's
    address given on the command line as on a cluster): one DeepSpeed ZeRO-2 job over both."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        cmd = [*launcher(), "launch", "--config_file", "accelerate_configs/zero2_multinode.yaml", "--machine_rank",
               str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port, "recipes/cls.py",
               *TINY_FLAGS, "--max_train_steps", "4", "--record_ranks", "--output_dir", str(tmp_path)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    resolved = json.loads((tmp_path / "run_config.json").read_text())
    assert resolved["world_size"] == 2 and resolved["distributed_type"] == "DEEPSPEED"
    ranks = rank_records(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["param_sums"] == ranks[1]["param_sums"]
    assert [s["step"] for s in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert read_jsonl(tmp_path / "eval.jsonl")[-1]["n_examples"] == 101
