"""Elastic resume: continue a checkpoint on another number of processes as the same training.

Why it can be the same training: the epoch order depends only on (seed, epoch), the even-shard sampler deals it in
rounds of `per_device_batch x world` samples, and the loss of a step is the mean over exactly the step's samples
(cls.loss_scale). So if the global batch `per_device_batch x accumulation x world` is kept, optimizer step k covers
the same samples whatever the world size, and a checkpoint that stores its position as samples consumed in the
epoch continues there. The user passes the new --gradient_accumulation_steps / --per_device_train_batch_size; nothing
is adjusted silently.

Per strategy:
- DDP / one process: model, optimizer and scheduler are replicated; every rank loads the same files.
- FSDP2 (SHARDED_STATE_DICT): torch.distributed.checkpoint reshards model and optimizer on load.
- DeepSpeed ZeRO-2/3: the per-rank partitions only fit the world that wrote them, so the checkpoint is converted
  once to DeepSpeed's universal format (`to_universal`) and loaded with `checkpoint.load_universal`.
RNG states: rank r < min(old, new world) continues its own saved streams; a rank that did not exist gets a fresh
deterministic stream (`seed_new_rank`); the streams of ranks that are gone end. Dropout masks therefore differ after
a world-size change (they would anyway: other ranks draw them for other samples), so equality holds without dropout.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from recipes import RecipeError

STATE_FILE = "trainer_state.json"  # checkpoint.TrainerState's file, which checkpoint.py reads through this name


def describe_layout(state: dict) -> str:
    return (f"{global_batch(state)} ({state['per_device_train_batch_size']} per device x "
            f"{state['gradient_accumulation_steps']} accumulation x {state['world_size']} processes)")


def global_batch(state: dict) -> int:
    return state["per_device_train_batch_size"] * state["gradient_accumulation_steps"] * state["world_size"]


def check_batch_layout(path: Path, saved: dict, now: dict, force: bool) -> None:
    """Another world size is fine when the global batch per step is unchanged; another batch or seed needs --force.

    With --force_resume the run continues from the same consumed-sample count of the epoch: the rest of the epoch is
    dealt in the new batch, so the step count, the learning-rate schedule's length and the loss curve change.
    """
    if saved["seed"] != now["seed"] and not force:
        raise RecipeError(f"checkpoint {path} was written with seed {saved['seed']}, not {now['seed']}: another sample "
                          "order; pass --force_resume to continue with the new order")
    if global_batch(saved) != global_batch(now) and not force:
        raise RecipeError(f"checkpoint {path}: global batch {describe_layout(saved)} -> {describe_layout(now)}: keep "
                          f"{global_batch(saved)} samples per step (e.g. --gradient_accumulation_steps "
                          f"{ideal_accumulation(saved, now)}), or pass --force_resume to continue from sample "
                          f"{saved['samples_in_epoch']} of epoch {saved['epoch']} with the new batch")


def ideal_accumulation(saved: dict, now: dict) -> str:
    """The accumulation that keeps the saved global batch with the new per-device batch and world, if one exists."""
    per_step = now["per_device_train_batch_size"] * now["world_size"]
    accum, rest = divmod(global_batch(saved), per_step)
    return str(accum) if accum and not rest else f"(none: {global_batch(saved)} is not a multiple of {per_step})"


def after_load(accelerator, optimizer, start) -> None:
    """Align Accelerate's accumulation counter with this run's plan; repair a ZeRO-3 universal load.

    `accelerator.load_state` (1.15.0) restores `accelerator.step`, the micro-batch counter whose multiples of the
    accumulation steps are the sync points, from the checkpoint; it counted the old world's micro-batches. A
    checkpoint is always written right after an optimizer step, where the counter of any plan is 0 modulo its
    accumulation, so 0 is the value the uninterrupted run has there.
    """
    accelerator.step = 0
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.zero_stage == 3 and start.path.name.endswith(".universal"):
        repair_zero3_universal_load(optimizer, start.path)


def repair_zero3_universal_load(optimizer, path: Path) -> None:
    """Undo two faults of DeepSpeed 0.19.8's ZeRO-3 universal load (stage3.py,
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`); ZeRO-2's load (base_optimizer.py) has neither:
    - it puts the same `step` tensor into the state of every sub-group; torch's AdamW increments `step` in place once
      per parameter, so the shared step advances once per sub-group per optimizer step (wrong bias correction);
    - it copies the hyperparameters of saved param group 0 into every group, so the no-decay group gets decay.
    Here each state gets its own step tensor and each group its own saved hyperparameters.
    """
    import torch
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

    from recipes.model.memstats import innermost_optimizer

    inner = innermost_optimizer(optimizer)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    saved_file = next(path.glob("*/zero/optimizer_state.pt"))
    saved = torch.load(saved_file, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT]["param_groups"]
    if len(saved) != len(inner.param_groups):
        raise RecipeError(f"{saved_file}: {len(saved)} optimizer groups saved, {len(inner.param_groups)} now")
    for group, saved_group in zip(inner.param_groups, saved):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def seed_new_rank(seed: int, rank: int, step: int) -> None:
    """The RNG streams of a rank the checkpoint has no state for: deterministic in (seed, rank, resume step)."""
    from accelerate.utils import set_seed

    set_seed(seed + 10_000 * step + rank)


def prepare_universal(accelerator, start):
    """Under DeepSpeed on another world size: convert the checkpoint to universal form and load it that way.

    Call before `accelerator.prepare` (the engine reads `checkpoint.load_universal` when it is built). Returns the
    resume point with its path on the converted checkpoint `step_N.universal` next to `step_N`, which stays untouched.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or not start.path or start.world_size == accelerator.num_processes:
        return start
    converted = start.path.with_name(start.path.name + ".universal")
    if accelerator.is_main_process and not is_conversion_of(converted, start.path):
        shutil.rmtree(converted, ignore_errors=True)  # of another step_N of that name: never load it
        to_universal(start.path, converted)
    accelerator.wait_for_everyone()
    if not converted.is_dir():
        raise RecipeError(f"converting {start.path} to a universal checkpoint failed: no {converted}")
    plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    accelerator.print(f"{start.path} was written by {start.world_size} processes: loading {converted}")
    return type(start)(**{**vars(start), "path": converted})


def is_conversion_of(converted: Path, src: Path) -> bool:
    """Whether `converted` was made from this very `src`: to_universal copies its trainer_state.json, which differs
    between two checkpoints of the same step (another attempt, another time). checkpoint.save_checkpoint also
    removes the conversion when it replaces its source; this catches one made before that rule."""
    try:
        return (converted / STATE_FILE).read_bytes() == (src / STATE_FILE).read_bytes()
    except OSError:
        return False


def to_universal(src: Path, dst: Path) -> None:
    """Copy a DeepSpeed checkpoint to `dst` with its engine folder in universal form, atomically (via dst.tmp).

    deepspeed.checkpoint.ds_to_universal (0.19.8) reads the engine folder Accelerate writes (`pytorch_model/`);
    Accelerate's save_state does not record the `universal_checkpoint_info` client state, so it is injected
    (`inject_missing_state`). Everything else in the checkpoint (scheduler, RNG states, trainer_state.json) is copied.
    """
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    engine_dirs = [p for p in src.iterdir() if p.is_dir() and p.name != "best"]  # best/: checkpoint.restore_best
    if len(engine_dirs) != 1:
        raise RecipeError(f"{src}: expected one DeepSpeed engine folder, found {[p.name for p in engine_dirs]}")
    shutil.copytree(src, tmp, ignore=lambda folder, names: [engine_dirs[0].name, "best"] if Path(folder) == src
                    else [])
    ds_to_universal(Namespace(input_folder=str(engine_dirs[0]), output_folder=str(tmp / engine_dirs[0].name),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True))
    tmp.rename(dst)
