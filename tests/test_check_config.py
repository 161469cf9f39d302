"""scripts/check_config.py: every shipped launch config is clean, each broken fixture is caught with its message.

Fast tier: no process is launched; the launched-process environment is made by accelerate's own env builders.
`tiny_model` (the offline tiny RoBERTa, built if missing) comes from conftest.py.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from helpers import REPO
from recipes.checks import launch_checks
from scripts import check_config

BAD = "tests/fixtures/bad_configs"
SHIPPED = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "accelerate_configs").glob("*.yaml"))


@pytest.fixture(autouse=True)
def at_repo_root(monkeypatch):
    # deepspeed_config_file paths are relative to the launch directory, the repository root.
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def meta_model(tiny_model):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny_model))


def test_every_shipped_config_is_listed():
    assert {Path(p).stem for p in SHIPPED} == {"single", "ddp", "fsdp", "zero2", "zero3", "zero2_offload",
                                               "zero3_offload", "multinode", "zero1", "zero2_multinode"}


@pytest.mark.parametrize("yaml_path", SHIPPED)
@pytest.mark.parametrize("recipe", [{}, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
                                         "max_grad_norm": 0.5}])
def test_shipped_config_is_clean(yaml_path, recipe, tiny_model):
    """Every shipped config is clean with and without accumulation, but ZeRO-1 with accumulation: its JSON keeps
    bf16 gradient accumulation off the fp32 path so that DeepSpeed's reduction overlaps backward, and accumulating
    in bf16 is refused, naming both ways out."""
    problems = check_config.check_yaml(yaml_path, recipe, tiny_model)
    if yaml_path.endswith("zero1.yaml") and recipe:
        assert len(problems) == 1 and "accumulates 4 micro-batches of bf16 gradients in bf16" in problems[0]
        assert "BF16_Optimizer" in problems[0] and "ds_configs/zero2.json" in problems[0]
    else:
        assert problems == []


def test_cpu_binding_variables_in_the_launching_shell_are_a_problem(monkeypatch):
    """accelerate launch imports torch; with OMP_PROC_BIND set its OpenMP binds the launcher to one CPU, which every
    rank inherits (tests/test_no_silent_change.py launches it)."""
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    problems = check_config.check_yaml("accelerate_configs/ddp.yaml", {})
    cpus = len(os.sched_getaffinity(0))
    assert problems == ([] if cpus < 2 else [
        f"OMP_PROC_BIND=close is set: accelerate launch loads OpenMP, which binds it to one CPU, and every process it "
        f"starts inherits that one of the {cpus} CPUs here: unset OMP_PROC_BIND for the launch (to bind each process, "
        "start it under taskset or numactl yourself)"])
    assert launch_checks.launcher_binding_problems({"GOMP_CPU_AFFINITY": "0-3"}, {0, 1, 2, 3})[0].startswith(
        "GOMP_CPU_AFFINITY=0-3 is set")
    for env, affinity in (({"OMP_PROC_BIND": "false", "OMP_PLACES": "cores"}, {0, 1}), ({}, {0, 1}),
                          ({"OMP_PROC_BIND": "true"}, {3}),  # one CPU: nothing to lose
                          ({"KMP_AFFINITY": "compact"}, {0, 1})):  # binds under Intel's OpenMP only
        assert launch_checks.launcher_binding_problems(env, affinity) == []


# (fixture, recipe flags, the one problem expected). Recipe defaults: micro-batch 32, accumulation 1, clipping 1.0.
CASES = [
    ("mp_twice", {}, "mixed precision set twice: mixed_precision=bf16 and tests/fixtures/bad_configs/bf16.json "
                     "bf16.enabled; keep it in the JSON only"),
    ("mp_disagree", {}, "mixed precision disagrees: mixed_precision=fp16 but tests/fixtures/bad_configs/bf16.json "
                        "enables bf16; keep it in the JSON only"),
    ("mp_no", {}, "mixed_precision: no next to a deepspeed_config_file: accelerate 1.15.0 refuses any "
                  "mixed_precision key there"),
    ("grad_accum", {}, "gradient_accumulation_steps=4 in tests/fixtures/bad_configs/bf16_grad_accum_4.json but "
                       "--gradient_accumulation_steps 1; set it to \"auto\" or pass --gradient_accumulation_steps 4"),
    ("micro_batch", {"per_device_train_batch_size": 8}, "train_micro_batch_size_per_gpu=16 in "
                     "tests/fixtures/bad_configs/bf16_micro_16.json but --per_device_train_batch_size 8"),
    ("train_batch", {}, "train_batch_size=100 in tests/fixtures/bad_configs/bf16_train_batch_100.json but "
                        "micro-batch 32 x accumulation 1 x 2 processes = 64"),
    ("clipping", {}, "gradient_clipping=0.5 in tests/fixtures/bad_configs/bf16_clipping_05.json but "
                     "--max_grad_norm 1.0"),
    ("fsdp_wrap_class", {}, "FSDP wrap class 'BertLayer' is not a module of {model} (its layer classes: "
                            "RobertaLayer); accelerate would fail in prepare()"),
    ("fsdp_wrap_spaces", {}, "FSDP wrap class list 'RobertaLayer, RobertaSelfAttention' has spaces: accelerate "
                             "1.15.0 does not strip them, write it as A,B"),
    ("ds_missing", {}, "deepspeed_config_file 'tests/fixtures/bad_configs/does_not_exist.json' not found"),
    ("ds_invalid", {}, "deepspeed_config_file 'tests/fixtures/bad_configs/invalid.json' is not valid JSON "
                       "(line 4, column 1)"),
    ("zero3_no_gather", {}, "tests/fixtures/bad_configs/zero3_no_gather.json is ZeRO-3 without "
                            "stage3_gather_16bit_weights_on_model_save: true, so writing final/ fails after training"),
    ("ds_owned_key", {}, "deepspeed_config.gradient_accumulation_steps next to deepspeed_config_file: "
                         "accelerate 1.15.0 refuses it"),
    ("unknown_key", {}, "unknown key 'num_process' (accelerate launch refuses it)"),
    ("fsdp_unknown_subkey", {}, "unknown key 'fsdp_config.fsdp_wrap_policy' (accelerate ignores it)"),
    ("distributed_type", {}, "unknown distributed_type 'MULTI_TPU' (one of NO, MULTI_CPU, MULTI_GPU"),
    ("unquoted_no", {}, "unknown distributed_type 'False' (one of NO"),
    ("num_processes_zero", {}, "num_processes=0 must be an integer >= 1"),
    ("num_processes_not_divisible", {}, "num_processes=3 is not divisible by num_machines=2"),
    ("dead_section", {}, "fsdp_config is set but distributed_type is MULTI_GPU, so it is ignored"),
]


@pytest.mark.parametrize("name,recipe,expected", CASES, ids=[c[0] for c in CASES])
def test_broken_fixture_is_caught(name, recipe, expected, tiny_model):
    problems = check_config.check_yaml(f"{BAD}/{name}.yaml", recipe, tiny_model)
    assert len(problems) == 1, problems  # each fixture holds exactly one mistake
    assert expected.format(model=tiny_model) in problems[0]


def test_unknown_deepspeed_json_keys():
    problems = check_config.check_yaml(f"{BAD}/ds_unknown_keys.yaml", {})
    path = "tests/fixtures/bad_configs/unknown_keys.json"
    assert problems == [f"unknown key 'gradient_clip' in {path}",
                        f"unknown key 'zero_optimization.stage3_gather_16bit_weights_on_save' in {path}",
                        # what the misspelling costs: the real key is missing
                        f"{path} is ZeRO-3 without stage3_gather_16bit_weights_on_model_save: true, so writing "
                        "final/ fails after training"]


def test_unquoted_no_gets_a_hint():
    (problem,) = check_config.check_yaml(f"{BAD}/unquoted_no.yaml", {})
    assert problem.endswith("an unquoted NO/no reads as YAML false: quote it")


def test_missing_yaml():
    assert check_config.check_yaml("accelerate_configs/zero4.yaml", {}) == [
        "config file not found: accelerate_configs/zero4.yaml"]


def test_missing_model_folder():
    (problem,) = check_config.check_yaml(f"{BAD}/fsdp_wrap_class.yaml", {}, "artifacts/no-such-model")
    assert problem.startswith("cannot build the model skeleton from artifacts/no-such-model")


def test_zero_keys_are_known_to_deepspeed():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    known = set(DeepSpeedZeroConfig.model_fields)
    known |= {f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
    assert launch_checks.DS_ZERO_KEYS <= known


def test_cli(capsys, tiny_model):
    assert check_config.main(["--all", "--model_name_or_path", str(tiny_model)]) == 0
    fsdp = "accelerate_configs/fsdp.yaml"  # names no wrap class: the checker says which the recipe picks
    loaded = f" (model {tiny_model}: RobertaForSequenceClassification, 1.5 M parameters)"  # for every file
    out = capsys.readouterr().out.splitlines()
    memory = [line for line in out if ": note: per GPU (" in line]  # one per file (test_memory_line_... below)
    assert [line for line in out if line not in memory] == [line for p in SHIPPED for line in [f"ok: {p}{loaded}"] + (
        [f"{fsdp}: note: FSDP shards RobertaLayer one at a time (_no_split_modules); outside this recipe write "
         "fsdp_transformer_layer_cls_to_wrap: RobertaLayer"] if p == fsdp else [])]
    assert [line.split(":")[0] for line in memory] == SHIPPED
    assert check_config.main(["accelerate_configs/ddp.yaml", f"{BAD}/num_processes_zero.yaml",
                              "--per_device_train_batch_size", "8"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "ok: accelerate_configs/ddp.yaml", f"{BAD}/num_processes_zero.yaml: num_processes=0 must be an integer >= 1"]
    with pytest.raises(SystemExit):  # the recipe's flags, unabbreviated: a typo is an error, not a silent match
        check_config.main(["--all", "--per_device_train_batch", "8"])


def test_help_says_what_each_negated_flag_does(capsys):
    """The checker takes the recipe's flags with the recipe's help: each --no_X says it turns X off, never X's own
    description (which read backwards: --no_tf32 "fp32 runs use TF32")."""
    from dataclasses import fields

    from recipes.config import Config

    NEGATED_HELP = {f.name: f.metadata["negated"] for f in fields(Config) if f.metadata.get("negated")}
    with pytest.raises(SystemExit) as stop:
        check_config.main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: scripts/check_config.py")
    assert {"tf32", "do_train", "do_eval", "eval_report"} <= set(NEGATED_HELP)
    for name, line in NEGATED_HELP.items():
        assert f"--no_{name}, --no-{name.replace('_', '-')} {line}" in text, name
    assert "same as --do_train false" in NEGATED_HELP["do_train"] and "no TF32" in NEGATED_HELP["tf32"]
    assert "same as --eval_report false" in NEGATED_HELP["eval_report"]


def test_the_launch_flags_take_the_place_of_the_yamls_values(capsys, tmp_path):
    """--num_processes, --num_machines, --mixed_precision, --deepspeed_config_file: as on the accelerate launch line,
    each wins over the YAML's value, so the launch checked is the one the user will make."""
    zero2, ddp = "accelerate_configs/zero2.yaml", "accelerate_configs/ddp.yaml"
    cases = [([ddp, "--num_processes", "3", "--num_machines", "2"], 1,
              f"{ddp}: num_processes=3 is not divisible by num_machines=2"),
             ([ddp, "--num_processes", "0"], 1, f"{ddp}: num_processes=0 must be an integer >= 1"),
             ([zero2, "--mixed_precision", "bf16"], 1, f"{zero2}: mixed precision set twice: mixed_precision=bf16 "
              "and ds_configs/zero2.json bf16.enabled; keep it in the JSON only"),
             ([zero2, "--deepspeed_config_file", "ds_configs/zero2_fp16.json"], 0, f"ok: {zero2}"),
             ([zero2, "--deepspeed_config_file", str(tmp_path / "none.json")], 1, f"{zero2}: "),
             ([ddp, "--deepspeed_config_file", "ds_configs/zero2.json"], 1, f"{ddp}: --deepspeed_config_file goes "
              "with a DeepSpeed YAML: with distributed_type MULTI_GPU accelerate launch does not use it"),
             ([ddp, "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"], 0, f"ok: {ddp}")]
    for argv, status, first in cases:
        assert check_config.main(argv) == status, argv
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith(first) and (len(out) == 1 or status == 1), (argv, out)
    assert "none.json" in check_config.check_yaml(zero2, {}, launch={"deepspeed_config_file": "none.json"})[0]


# ---- inside a launched process: the environment accelerate launch builds from a YAML ----
def launch_env(yaml_path: str, world_size: int = 2) -> dict:
    """The environment `accelerate launch --config_file yaml_path` gives each process, built by accelerate's own
    code without starting anything (torchrun adds WORLD_SIZE)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, mp_from_config = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", yaml_path, "recipes/cls.py"]))
    with warnings.catch_warnings():  # another job may hold port 29500; only the environment matters here
        warnings.simplefilter("ignore")
        if args.use_deepspeed:  # what launch_command does before calling the DeepSpeed launcher
            fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, env = prepare_deepspeed_cmd_env(args)
        else:
            env = prepare_multi_gpu_env(args)
    return {**env, "WORLD_SIZE": str(world_size)}


@pytest.mark.parametrize("yaml_path", ["accelerate_configs/zero3_offload.yaml", "accelerate_configs/fsdp.yaml"])
def test_launch_env_clean(yaml_path, meta_model):
    assert check_config.check_launch_env(launch_env(yaml_path), {"per_device_train_batch_size": 8}, meta_model) == []


def test_launch_env_precision_set_twice():
    assert check_config.check_launch_env(launch_env(f"{BAD}/mp_twice.yaml"), {}) == [
        "mixed precision set twice: mixed_precision=bf16 and tests/fixtures/bad_configs/bf16.json bf16.enabled; "
        "keep it in the JSON only"]


def test_launch_env_precision_no_refused():
    (problem,) = check_config.check_launch_env(launch_env(f"{BAD}/mp_no.yaml"), {})
    assert problem.startswith("mixed_precision: no next to a deepspeed_config_file: accelerate 1.15.0 refuses")


def test_launch_env_batch_sizes():
    env = launch_env(f"{BAD}/train_batch.yaml", world_size=4)
    assert check_config.check_launch_env(env, {"per_device_train_batch_size": 25}) == []
    assert check_config.check_launch_env(env, {}) == [
        "train_batch_size=100 in tests/fixtures/bad_configs/bf16_train_batch_100.json but micro-batch 32 x "
        "accumulation 1 x 4 processes = 128"]
    assert check_config.check_launch_env(launch_env(f"{BAD}/grad_accum.yaml"), {"gradient_accumulation_steps": 2}) == [
        "gradient_accumulation_steps=4 in tests/fixtures/bad_configs/bf16_grad_accum_4.json but "
        "--gradient_accumulation_steps 2; set it to \"auto\" or pass --gradient_accumulation_steps 4"]


def test_launch_env_wrap_class(meta_model):
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
           "FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer", "WORLD_SIZE": "2"}
    (problem,) = check_config.check_launch_env(env, {}, meta_model)
    assert problem.startswith("FSDP wrap class 'BertLayer' is not a module of the model (its layer classes: "
                              "RobertaLayer)")
    assert check_config.check_launch_env(env, {}) == []  # no model yet: nothing to check
    # RobertaEmbeddings is in RoBERTa's _no_split_modules, but holds the embedding Accelerate shards by itself
    (problem,) = check_config.check_launch_env({**env, "FSDP_TRANSFORMER_CLS_TO_WRAP": "RobertaEmbeddings"}, {},
                                               meta_model)
    assert problem.startswith("FSDP wrap class 'RobertaEmbeddings' holds the input embedding")
    del env["FSDP_TRANSFORMER_CLS_TO_WRAP"]  # none named (the shipped fsdp.yaml): the recipe chooses RobertaLayer
    assert check_config.check_launch_env(env, {}, meta_model) == []
    import torch

    (problem,) = check_config.check_launch_env(env, {}, torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert problem.startswith("cannot tell which layers of Sequential FSDP should shard one at a time: set "
                              "fsdp_transformer_layer_cls_to_wrap in the launch YAML")


def test_launch_env_missing_json():
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero4.json",
           "ACCELERATE_MIXED_PRECISION": "no", "WORLD_SIZE": "2"}
    assert check_config.check_launch_env(env, {}) == [
        "deepspeed_config_file 'ds_configs/zero4.json' not found (relative paths are read from where you launch)"]


# ---- fewer processes than GPUs: a warning, in the checker and once per machine at start-up ----
IDLE_8 = ("2 processes on this machine but 8 GPUs visible: 6 stay idle; to use them all: accelerate launch "
          "--num_processes 8")


@pytest.mark.parametrize("gpus,expected", [(8, [IDLE_8]), (2, []), (0, [])], ids=["8_gpus", "2_gpus", "cpu"])
def test_fewer_processes_than_gpus_warns(monkeypatch, capsys, gpus, expected):
    """zero2.yaml's 2 processes on an 8-GPU machine train on 2 GPUs: a warning naming the flag, not a problem; none
    when the counts match, none in a CPU rehearsal (no GPU)."""
    monkeypatch.setattr(launch_checks, "visible_gpus", lambda: gpus)
    warned = []
    assert check_config.check_yaml("accelerate_configs/zero2.yaml", {}, warnings=warned) == []
    assert warned == expected
    torchrun = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    launch_checks.check_devices({**torchrun, "LOCAL_RANK": "0"})
    assert capsys.readouterr().err == "".join(f"warning: {w}\n" for w in expected)
    launch_checks.check_devices({**torchrun, "LOCAL_RANK": "1"})  # once per machine: local rank 0 only
    assert capsys.readouterr().err == ""
    assert check_config.main(["accelerate_configs/zero2.yaml"]) == 0  # a warning keeps exit status 0
    assert capsys.readouterr().out.splitlines() == [
        *(f"accelerate_configs/zero2.yaml: warning: {w}" for w in expected), "ok: accelerate_configs/zero2.yaml"]


def test_fewer_processes_than_gpus_names_the_total_over_machines(monkeypatch, capsys):
    monkeypatch.setattr(launch_checks, "visible_gpus", lambda: 8)
    total = "--num_processes 16 (8 per machine x 2 machines)"
    launch_checks.check_devices({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert capsys.readouterr().err.endswith(f"6 stay idle; to use them all: accelerate launch {total}\n")
    warned = []
    check_config.check_yaml("accelerate_configs/multinode.yaml", {}, warnings=warned)  # 1 process per machine
    assert warned == [f"1 process on this machine but 8 GPUs visible: 7 stay idle; to use them all: accelerate "
                      f"launch {total}"]
    warned = []
    check_config.check_yaml("accelerate_configs/single.yaml", {}, warnings=warned)  # one device by design
    assert warned == []


def test_plain_python_on_many_gpus_names_launch_and_data_parallel(monkeypatch, capsys):
    """`python recipes/cls.py` is one process: told about the idle GPUs unless --data_parallel uses them."""
    monkeypatch.setattr(launch_checks, "visible_gpus", lambda: 8)
    launch_checks.check_devices({}, data_parallel=False)
    err = capsys.readouterr().err
    assert err.startswith("warning: 1 process on this machine but 8 GPUs visible: 7 stay idle")
    assert "accelerate launch --num_processes 8" in err and "--data_parallel" in err
    launch_checks.check_devices({}, data_parallel=True)
    launch_checks.check_devices({})  # the caller did not say: no guess
    assert capsys.readouterr().err == ""


# ---- --write_resolved: the DeepSpeed JSON for plain `deepspeed`, every "auto" filled ----
RESOLVE_FLAGS = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5"]


def write_resolved(yaml_path: str, out: Path, model) -> dict:
    argv = [yaml_path, "--write_resolved", str(out), "--model_name_or_path", str(model), "--num_processes", "8"]
    assert check_config.main(argv + RESOLVE_FLAGS) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero2_offload"])
def test_resolved_json_is_accepted_by_deepspeed_at_its_world_size(name, tmp_path, tiny_model, capsys):
    config = write_resolved(f"accelerate_configs/{name}.yaml", tmp_path / "ds.json", tiny_model)
    assert '"auto"' not in json.dumps(config)
    ds = check_config.deepspeed_parse(config, 8)
    assert ds.world_size == 8
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps, ds.train_batch_size) == (4, 2, 64)
    assert ds.gradient_clipping == 0.5  # the recipe's --max_grad_norm, not Accelerate's 1.0
    shipped = json.loads(Path(f"ds_configs/{name}.json").read_text())
    assert config["zero_optimization"] == shipped["zero_optimization"]  # numbers given in the file stay
    assert config["steps_per_print"] == shipped["steps_per_print"]  # not Accelerate's infinity
    if "offload" in name:  # DeepSpeed builds its CPU Adam itself, with the recipe's AdamW values
        assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                                    "weight_decay": 0.01}}
        assert ds.optimizer_name == "adamw" and "model_parameters=<param groups>" in capsys.readouterr().out
    else:
        assert "optimizer" not in config
    # What the check means: the same files are refused at another world size, and unresolved.
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        check_config.deepspeed_parse(config, 2)
    with pytest.raises(TypeError):
        check_config.deepspeed_parse(shipped, 8)


def test_resolved_bucket_sizes_come_from_the_hidden_size(tmp_path, tiny_model):
    """A JSON that leaves the ZeRO-3 sizes "auto" gets Accelerate 1.15.0's values for hidden size 128."""
    import yaml

    ds = json.loads(Path("ds_configs/zero3.json").read_text())
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        ds["zero_optimization"][key] = "auto"
    (tmp_path / "zero3_auto.json").write_text(json.dumps(ds))
    launch = yaml.safe_load(Path("accelerate_configs/zero3.yaml").read_text())
    launch["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / "zero3_auto.json")
    (tmp_path / "zero3_auto.yaml").write_text(yaml.safe_dump(launch))
    config = write_resolved(str(tmp_path / "zero3_auto.yaml"), tmp_path / "ds.json", tiny_model)
    zero = check_config.deepspeed_parse(config, 8).zero_config
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        128 * 128, int(0.9 * 128 * 128), 10 * 128)


def test_write_resolved_refuses_a_yaml_without_deepspeed(tmp_path, capsys):
    assert check_config.main(["accelerate_configs/ddp.yaml", "--write_resolved", str(tmp_path / "ds.json")]) == 1
    assert "is not a DeepSpeed YAML" in capsys.readouterr().out and not (tmp_path / "ds.json").exists()


# ---- memory per GPU: model state (scripts/memory_model.py) + activations measured small and scaled ----

def test_each_shipped_yaml_maps_to_its_memory_model_strategy():
    strategies = {p: check_config.launch_settings(p, {})[:3] for p in SHIPPED}
    assert {Path(p).stem: s[0] for p, s in strategies.items()} == {
        "ddp": "ddp", "fsdp": "fsdp", "multinode": "ddp", "single": "single", "zero1": "zero1", "zero2": "zero2",
        "zero2_multinode": "zero2", "zero2_offload": "zero2_offload", "zero3": "zero3",
        "zero3_offload": "zero3_offload"}
    assert strategies["accelerate_configs/zero2.yaml"][1:] == (2, "bf16")
    assert strategies["accelerate_configs/ddp.yaml"][1:] == (2, "fp32")
    assert check_config.launch_settings("accelerate_configs/zero2.yaml", {"num_processes": 8})[1] == 8


def test_memory_line_is_the_model_state_plus_the_scaled_activations(tiny_model):
    from scripts.measure import activation_memory
    from scripts import memory_model as mm

    recipe = check_config.recipe_flags({"model_name_or_path": str(tiny_model), "per_device_train_batch_size": 8,
                                        "max_length": 64})
    cache = {}
    line, fits = check_config.memory_line("accelerate_configs/zero2.yaml", recipe, {"num_processes": 4}, 100.0, cache)
    # the activations of the whole micro-batch, as scripts/measure/activation_memory.py measures them, within 5%
    measured = activation_memory.measure(str(tiny_model), 8, 64, False)["activations"]
    assert abs(cache[False] / measured - 1) <= 0.05, (cache, measured)
    state = mm.totals(mm.predict("zero2", mm.shape_from_model(str(tiny_model)), 4, "bf16",
                                 ds_config=json.loads((REPO / "ds_configs" / "zero2.json").read_text())))["device_peak"]
    assert line.startswith(f"per GPU (zero2, 4 processes, bf16): model state {state / mm.GIB:.2f} GiB at its peak")
    assert "micro-batch 8 x 64 tokens, gradient checkpointing off, measured in fp32: bf16 keeps less" in line and fits
    line, fits = check_config.memory_line("accelerate_configs/zero2.yaml", recipe, {}, 0.001, cache)
    assert not fits and "more than --gpu_memory 0.001: lower --per_device_train_batch_size" in line
    assert check_config.main(["accelerate_configs/zero2.yaml", "--model_name_or_path", str(tiny_model),
                              "--gpu_memory", "0.001"]) == 1
