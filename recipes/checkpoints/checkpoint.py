"""Checkpoints for exact resume: save atomically, find the one to resume from, load and verify it, trim records.

A checkpoint is `checkpoints/step_N/` (Accelerate's `save_state`: model, optimizer, scheduler, every rank's RNG
states; DeepSpeed and FSDP shards from every rank) plus `trainer_state.json`: the step, the position in the data as
samples consumed in the epoch, the batch layout (per-device batch, world size, accumulation) it was written with,
and its length grouping (the resumed epoch keeps that order, whatever this run's --group_by_length). The file
`checkpoints/latest` names the newest complete one; --save_total_limit removes older ones once a new one is complete
(rotate_checkpoints); a preempted run leaves `checkpoints/PREEMPTED` beside them. Resuming on another world size is
in elastic.py; preemption in preemption.py; the best model and early stopping in best_model.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import torch

from recipes import RecipeError, hooks
from recipes.checkpoints import elastic
from recipes.model import adapters, compilation

STATE_FILE = elastic.STATE_FILE  # beside Accelerate's files in every checkpoint
PREEMPTED_MARKER = "PREEMPTED"  # checkpoints/PREEMPTED names the checkpoint a preempted run wrote; a resume removes it
STEP_NAME = re.compile(r"step_(\d+)")


@dataclass
class TrainerState:
    """A checkpoint's own state beside Accelerate's (model, optimizer, scheduler, RNGs): its trainer_state.json,
    written by `write` and read by `read`, nowhere else."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # the epoch the data continue in ...
    samples_in_epoch: int = 0  # ... after these samples of it (on all ranks together)
    world_size: int = 1  # the batch layout it was written with: processes, ...
    gradient_accumulation_steps: int = 1  # ... accumulation ...
    per_device_train_batch_size: int = 0  # ... and micro-batch (--auto_micro_batch keeps it: training/micro_batch.py)
    seed: Optional[int] = None  # its --seed, which ordered the epoch in progress
    length_group: int = 0  # its --group_by_length group (global batch) that ordered the epoch; 0: a permutation
    skipped_steps: int = 0  # optimizer steps skipped on fp16 overflow before it (their windows count)
    long_run: Optional[dict] = None  # the best-so-far and patience count (best_model.BestModel.state)
    eval_pending: bool = False  # written on a preemption before the evaluation due at its step: run that first
    finished: bool = False  # written at the end of training (the last step, or an early stop)
    contract: Optional[dict] = None  # the training it is part of (contract.py); None: written before contracts
    cuda_devices: Optional[list] = None  # each saving rank's local CUDA device index (agree_saved); None: CPU or older
    stream: Optional[dict] = None  # --streaming: the stream's position after this step (inputs/streaming.py)

    @property
    def layout(self) -> dict:
        return {"per_device_train_batch_size": self.per_device_train_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps, "world_size": self.world_size}

    @property
    def global_batch(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size

    def write(self, folder: Path) -> None:
        (folder / STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, folder: Path) -> "TrainerState":
        """The state in `folder`; a field an older checkpoint lacks takes its default."""
        try:
            saved = json.loads((folder / STATE_FILE).read_text())
            return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})
        except (OSError, ValueError, TypeError) as err:
            raise RecipeError(f"checkpoint {folder} has no readable {STATE_FILE}: {err}") from None


@dataclass
class ResumePoint(TrainerState):
    """Where training (re)starts: the state of the checkpoint at `path` (None, with the defaults: a fresh start) and
    what this run changes from it."""

    path: Optional[Path] = None
    changes: list = field(default_factory=list)  # contract.Change applied from this checkpoint on (--force_resume)
    best_restarts: bool = False  # an applied change of the evaluation: best/ and the patience count start again


def check_shared_output_dir(accelerator, out: Path) -> None:
    """Fail at start-up, on every rank, when --output_dir is not one folder that all machines see.

    Checkpoints need it: every rank writes its RNG state and shards into step_N.tmp, which only rank 0 renames,
    and every rank reads them back on resume. On node-local disks another machine's rank would raise alone at its
    first checkpoint while the others wait in a collective until --ddp_timeout. Rank 0 writes a random token; after
    a barrier every rank reads it back, and the verdicts are gathered so that all ranks stop together.
    """
    if accelerator.num_processes == 1:
        return
    import secrets

    from accelerate.utils import broadcast_object_list, gather_object

    created = not out.exists()
    token = [secrets.token_hex(8) if accelerator.is_main_process else None]
    broadcast_object_list(token)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".shared_check").write_text(token[0])
    accelerator.wait_for_everyone()
    try:
        seen = (out / ".shared_check").read_text() == token[0]
    except OSError:
        seen = False
    verdicts = gather_object([(accelerator.process_index, seen)])
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (out / ".shared_check").unlink(missing_ok=True)
        if created and not any(out.iterdir()):  # leave no trace: a run that stops later writes nothing
            out.rmdir()
    blind = [rank for rank, ok in verdicts if not ok]
    if blind:
        raise RecipeError(f"--output_dir {out} is not shared: rank(s) {', '.join(map(str, blind))} cannot see what "
                          "rank 0 writes there; checkpoints need one folder that every machine sees (a shared "
                          "filesystem)")


def checkpoint_due(every: str | None, step: int, end_of_epoch: bool, last: bool = False) -> bool:
    """Whether step `step` is saved: every N steps, or at each epoch's end, and always the last step of the run, so
    that a relaunch of the finished run knows it is finished (best_model.finished_before)."""
    if not every:
        return False
    if every == "epoch":
        return end_of_epoch or last
    return step % int(every) == 0 or last


def save_checkpoint(accelerator, out: Path, state: TrainerState, keep: Optional[int] = None) -> Path:
    """Save everything resume needs, atomically: a complete checkpoint or none; then keep the newest `keep`.

    Every rank writes into checkpoints/step_N.tmp (DeepSpeed and FSDP save shards from every rank, and each rank its
    RNG state); only when all are done does rank 0 rename it to step_N and then replace the `latest` pointer file, so
    a crash at any point leaves `latest` naming the previous complete checkpoint. A save that fails on any rank (disk
    full, quota, an unwritable folder) stops every rank with one RecipeError, since the ranks compare their verdicts
    after each phase; `latest` then still names the previous checkpoint. Older checkpoints are removed only after
    the new one is complete (rotate_checkpoints), unlike Accelerate's own `total_limit`, which removes first.
    """
    root = out / "checkpoints"
    name = f"step_{state.step}"
    tmp = root / f"{name}.tmp"
    error = None
    if accelerator.is_main_process:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as err:
            error = err
    agree_saved(accelerator, name, error)
    try:
        accelerator.save_state(str(tmp))
        hooks.reached("saved", state.step)
    except Exception as err:  # noqa: BLE001 - any rank's failure, reported by every rank below
        error = err
    devices = agree_saved(accelerator, name, error, torch.cuda.current_device() if torch.cuda.is_available() else None)
    if accelerator.is_main_process:
        try:
            replace(state, cuda_devices=devices).write(tmp)
            if (out / "best").is_dir():  # the best as of this step, for a resume from here (restore_best)
                link_tree(out / "best", tmp / "best")
            shutil.rmtree(root / f"{name}.universal", ignore_errors=True)  # converted from the step_N it replaces
            shutil.rmtree(root / name, ignore_errors=True)
            tmp.rename(root / name)
            (root / "latest.tmp").write_text(name + "\n")
            os.replace(root / "latest.tmp", root / "latest")
        except OSError as err:
            error = err
    agree_saved(accelerator, name, error)
    if accelerator.is_main_process:
        rotate_checkpoints(root, keep)
    return root / name


def rotate_checkpoints(root: Path, keep: Optional[int]) -> list[str]:
    """Remove the oldest complete checkpoints beyond the newest `keep` (with their `.universal` conversions), never
    the one `latest` names. Called by rank 0 after a new checkpoint is complete and `latest` names it, so a crash
    at any point leaves at least the newest complete one. Half-written `step_N.tmp` folders are not touched. Every
    checkpoint here is this run's: a fresh run does not start in a folder holding another run's (find_checkpoint),
    and a resume removes the ones after its checkpoint (prepare_output_dir)."""
    if not keep or not root.is_dir():
        return []
    pointer = root / "latest"
    latest = pointer.read_text().strip() if pointer.is_file() else None
    steps = [(step, p.name) for step, p in complete_checkpoints(root)]
    doomed = [name for _, name in steps[:-keep] if name != latest] if len(steps) > keep else []
    for name in doomed:
        shutil.rmtree(root / f"{name}.universal", ignore_errors=True)
        shutil.rmtree(root / name)
    return doomed


def agree_saved(accelerator, name: str, error: Optional[BaseException], device=None) -> list:
    """Every rank's verdict on a phase of saving checkpoint `name` (a collective); a RecipeError on every rank if any
    failed. Returns each rank's `device`, by rank: the CUDA device index it computes on (None on CPU).

    Why the devices are recorded: Accelerate 1.15.0 saves every visible device's CUDA generator state in each rank's
    random_states_<rank>.pkl, by device number (`torch.cuda.get_rng_state_all`), and restores them by number: on
    another layout of GPUs per machine (2 x 4 -> 1 x 8, or back) rank r sits on another device number than when it
    saved, so its own stream is found only through the number it had then (restore_cuda_rng).
    """
    verdicts = gather_verdicts(accelerator, error, extra=device)
    failed = [(rank, why) for rank, (_, why) in enumerate(verdicts) if why]
    if failed:
        rank, why = failed[0]
        raise RecipeError(f"saving checkpoint {name} failed on rank(s) {', '.join(str(r) for r, _ in failed)} "
                          f"(rank {rank}: {why}); checkpoints/latest still names the previous complete checkpoint")
    return [d for d, _ in verdicts]


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under `root`, oldest first: a step_N folder holds its
    trainer_state.json only once every rank has saved (save_checkpoint renames step_N.tmp last)."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir()
                  if p.is_dir() and (m := STEP_NAME.fullmatch(p.name)) and (p / STATE_FILE).is_file())


def newest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint, whatever `latest` says: the pointer is written after the rename, so a crash
    in between leaves it one behind, and a lost pointer must not turn a restart into a fresh start."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


# What a run writes into --output_dir (README "What a run writes"): --overwrite_output_dir removes these, nothing else.
RUN_OUTPUTS = ("checkpoints", "final", "best", "metrics.jsonl", "eval.jsonl", "run_config.json", "predictions.jsonl",
               "eval_report", "ranks", "profile", "cls", "mlruns", "final.tmp", "best.tmp")
# What a run writes after training, from final/'s weights.
END_OF_RUN = ("eval_report", "predictions.jsonl")
# What a run without training (--do_train false) writes; the others are a training run's, never touched by it.
EVALUATION_OUTPUTS = ("eval.jsonl", "predictions.jsonl", "eval_report", "run_config.json", "cls", "mlruns")


def earlier_run(out: Path, records: bool = True) -> list[str]:
    """What of an earlier run is in `out`: its complete checkpoints, final/ and (with `records`) the other outputs
    a run writes (empty: none)."""
    found = [f"checkpoints/{p.name}" for _, p in complete_checkpoints(out / "checkpoints")]
    found = found[-2:] + (["final/"] if (out / "final").is_dir() else [])
    if records:
        found += [name + ("/" if (out / name).is_dir() else "") for name in RUN_OUTPUTS
                  if name not in ("checkpoints", "final") and (out / name).exists()]
    return found


def training_outputs(out: Path) -> list[str]:
    """The outputs in `out` that only a training run writes."""
    checkpoints = out / "checkpoints"
    return [name + ("/" if (out / name).is_dir() else "") for name in RUN_OUTPUTS
            if name not in EVALUATION_OUTPUTS and (out / name).exists()
            and not (name == "checkpoints" and checkpoints.is_dir() and not any(checkpoints.iterdir()))]


def find_checkpoint(cfg, world_size: int) -> ResumePoint:
    """The checkpoint to resume from; a fresh start without --resume_from_checkpoint.

    `latest` and `auto` take the newest complete checkpoint of --output_dir; `auto` starts fresh when there is none,
    so that one command serves the first start and every restart (by an elastic agent, a requeue): the records of
    an attempt that wrote no checkpoint are then its own to replace. A fresh start in a folder that holds an earlier
    run's outputs stops, unless --overwrite_output_dir replaces that run (prepare_output_dir). A run without
    training (--do_train false) never changes a training run's outputs: it stops in a folder that holds any.
    """
    out = Path(cfg.output_dir)
    if not cfg.do_train:
        found = training_outputs(out)
        if found:
            raise RecipeError(f"--output_dir {out} holds a training run ({', '.join(found)}): a run with --do_train "
                              "false writes eval.jsonl and predictions.jsonl and never changes a training run's "
                              "outputs; give another --output_dir")
        return ResumePoint()
    if not cfg.resume_from_checkpoint:
        path = None
    elif cfg.resume_from_checkpoint in ("latest", "auto"):
        root = out / "checkpoints"
        path = newest_checkpoint(root)
        if path is None and any(STEP_NAME.fullmatch(p.name) for p in (root.iterdir() if root.is_dir() else [])):
            raise RecipeError(f"--resume_from_checkpoint {cfg.resume_from_checkpoint}: {root} holds step_N folders but "
                              "none is complete (no trainer_state.json): a save was cut short; remove them or resume "
                              "from a checkpoint folder of your own")
        if path is None and cfg.resume_from_checkpoint == "latest":
            raise RecipeError(f"--resume_from_checkpoint latest: no checkpoint in {root}")
    else:
        path = Path(cfg.resume_from_checkpoint)
    if path is None:
        found = earlier_run(out, records=cfg.resume_from_checkpoint != "auto")
        if found and not cfg.overwrite_output_dir:
            resume = "--resume_from_checkpoint auto" if any(f.startswith("checkpoints") for f in found) else None
            raise RecipeError(f"--output_dir {out} holds an earlier run ({', '.join(found)}): "
                              + (f"continue it with {resume}, or " if resume else "")
                              + "replace it with --overwrite_output_dir, or choose another --output_dir")
        return ResumePoint()
    state = TrainerState.read(path)
    if state.contract is None:  # written before contracts: its seed and batch layout are what it can be held to
        now = {"world_size": world_size, "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
               "per_device_train_batch_size": cfg.per_device_train_batch_size, "seed": cfg.seed}
        elastic.check_batch_layout(path, {**state.layout, "seed": state.seed,
                                          "samples_in_epoch": state.samples_in_epoch, "epoch": state.epoch},
                                   now, cfg.force_resume)
    for rank in range(min(world_size, state.world_size)):  # ranks that exist now and existed then
        if not (path / f"random_states_{rank}.pkl").is_file():
            raise RecipeError(f"checkpoint {path} has no RNG state for rank {rank} (random_states_{rank}.pkl)")
    return ResumePoint(**asdict(state), path=path)


def load_checkpoint(accelerator, optimizer, scheduler, start: ResumePoint, seed: int) -> None:
    """`accelerator.load_state`, then check the RNG state really came back; set up what a new world needs; keep the
    schedule on the optimizer that steps (schedule_stepping_groups).

    Accelerate 1.15.0 swallows any error while restoring RNG states (it logs "Could not load random states" at info
    level) and the run would silently draw other dropout masks; here that fails the resume instead. A rank that did
    not exist when the checkpoint was written gets a fresh deterministic stream (elastic.seed_new_rank).
    """
    error = None
    try:
        restore(accelerator, optimizer, scheduler, start, seed)
    except Exception as err:  # noqa: BLE001 - any rank's failure, reported by every rank below
        error = err
    failed = [(rank, why) for rank, (_, why) in enumerate(gather_verdicts(accelerator, error)) if why]
    if failed:
        rank, why = failed[0]
        raise RecipeError(f"cannot resume from checkpoint {start.path}: rank {rank}: {why}; nothing in --output_dir "
                          "was changed") from None


def restore(accelerator, optimizer, scheduler, start: ResumePoint, seed: int) -> None:
    """load_checkpoint's work on one rank."""
    from accelerate.utils import load  # torch.load with weights_only=True and numpy's RNG types allow-listed

    rank = accelerator.process_index
    accelerator.load_state(str(start.path))
    elastic.after_load(accelerator, optimizer, start)
    schedule_stepping_groups(optimizer, scheduler)
    if rank >= start.world_size:
        elastic.seed_new_rank(seed, rank, start.step)
        return
    saved = load(start.path / f"random_states_{rank}.pkl")
    if "torch_manual_seed" not in saved or not torch.equal(saved["torch_manual_seed"], torch.get_rng_state()):
        raise RecipeError(f"the CPU RNG state of rank {rank} was not restored")
    if torch.cuda.is_available():
        restore_cuda_rng(saved, start, rank)


def gather_verdicts(accelerator, error: Optional[BaseException], extra=None) -> list[tuple]:
    """Every rank's (`extra`, its error as one line or None), by rank: a collective on several processes."""
    from recipes import first_line

    mine = (extra, None if error is None else str(error) if isinstance(error, RecipeError)
            else f"{type(error).__name__}: {first_line(error)}")
    if accelerator.num_processes == 1:
        return [mine]
    from accelerate.utils import gather_object

    return gather_object([mine])


def schedule_stepping_groups(optimizer, scheduler) -> None:
    """Point the learning-rate schedule at the param groups of the optimizer that steps, after a load.

    With `offload_optimizer`, Accelerate 1.15.0 gives DeepSpeed a DeepSpeedCPUAdam built on the recipe's AdamW's
    param-group dicts (`map_pytorch_optim_to_deepspeed`) and leaves torch's schedule on that AdamW. Loading a checkpoint
    of the same world, DeepSpeed 0.19.8 (stage_1_and_2 `_load_legacy_checkpoint`, stage3 `_rigid_load_state_dict`)
    calls torch's `Optimizer.load_state_dict` on the CPU Adam, which replaces its group dicts with new ones: the
    schedule then wrote its rates into dicts nothing read, each step after the resume used the rate saved in the
    checkpoint, and metrics.jsonl logged the schedule's rate (measured: zero2_offload.yaml, linear decay, resumed at
    step 4 of 8: the losses left the uninterrupted run's at step 7, 0.7402 against 0.7584 at step 8). Without offload
    the schedule's optimizer is the one that steps and this changes nothing.
    """
    from recipes.model.memstats import innermost_optimizer

    schedule = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper keeps torch's scheduler
    stepping = innermost_optimizer(optimizer)
    if schedule.optimizer is not stepping:
        schedule.optimizer = stepping
    rates = [group["lr"] for group in stepping.param_groups]
    if rates != schedule.get_last_lr():
        raise RecipeError(f"checkpoint: the optimizer resumes at learning rates {rates}, its schedule at "
                          f"{schedule.get_last_lr()}")


def restore_cuda_rng(saved: dict, start: ResumePoint, rank: int) -> None:
    """Put the CUDA generator state rank `rank` saved onto the device it computes on now, and check it.

    GPU dropout draws from the generator of the current device. Accelerate 1.15.0 restores the saved states by
    device number, inside a try/except that swallows errors (`load_accelerator_state`): with another number of GPUs
    per machine a rank would continue another device's stream, or none. The state to use is the one of the device
    the rank computed on when it saved (`cuda_devices` in trainer_state.json; a checkpoint without it was written
    before this was recorded: the same device number is assumed).
    """
    device = torch.cuda.current_device()
    states = saved.get("torch_cuda_manual_seed")
    recorded = start.cuda_devices[rank] if start.cuda_devices and rank < len(start.cuda_devices) else None
    index = device if recorded is None else recorded
    if states is None or index >= len(states):
        raise RecipeError(f"checkpoint {start.path}: rank {rank} saved from cuda:{index}, but random_states_{rank}.pkl "
                          f"holds CUDA RNG states for {0 if states is None else len(states)} device(s)")
    torch.cuda.set_rng_state(states[index], device)
    if not torch.equal(states[index], torch.cuda.get_rng_state(device)):
        raise RecipeError(f"checkpoint {start.path}: the CUDA RNG state of rank {rank} (cuda:{device}) was not "
                          "restored")


def save_weights(accelerator, model, tokenizer, folder: Path, info: Optional[dict] = None) -> None:
    """Write a folder `from_pretrained` loads (final/, best/) through a temporary one, so a crash never leaves it
    half-written; `info` (best/: the evaluation that made it the best) goes beside the weights as best_model.json."""
    accelerator.wait_for_everyone()
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)
    if adapters.is_adapted(plain):  # --use_peft: adapter/ and the merged model (recipes/model/adapters.py)
        write = adapters.weights_writer(accelerator, plain)  # a collective: every rank calls it
    else:
        state_dict = accelerator.get_state_dict(model)  # a collective under ZeRO-3 / FSDP: every rank calls it
        state_dict = compilation.uncompiled_names(state_dict)
        write = lambda tmp: plain.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)  # noqa: E731
    if accelerator.is_main_process:
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        tokenizer.save_pretrained(tmp)
        if info is not None:
            (tmp / "best_model.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    accelerator.wait_for_everyone()


def copy_weights(src: Path, folder: Path) -> None:
    """Copy a weights folder (best/ -> final/ for --load_best_model_at_end) through a temporary one."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def prepare_output_dir(out: Path, start: ResumePoint, overwrite: bool = False, training: bool = True) -> None:
    """Rank 0, after the checkpoint (if any) has loaded on every rank: until then nothing in `out` changes.

    A resumed run keeps the records up to its checkpoint, takes over from a preemption's marker, drops the
    checkpoints an abandoned attempt wrote after it (they are another history: rotation, `auto` and `latest` must
    never pick them) and puts back best/ as it was at the checkpoint (none when the best restarts). A fresh run starts
    from an empty record: its earlier outputs go (find_checkpoint allowed them: --overwrite_output_dir, or `auto` with
    an attempt that saved no checkpoint). A run without training replaces only its own earlier outputs."""
    out.mkdir(parents=True, exist_ok=True)
    if start.path:
        truncate_records(out, start.step)
        root = out / "checkpoints"
        (root / PREEMPTED_MARKER).unlink(missing_ok=True)
        later = [p for step, p in complete_checkpoints(root) if step > start.step]
        for folder in later:
            shutil.rmtree(folder.with_name(folder.name + ".universal"), ignore_errors=True)
            shutil.rmtree(folder)
        if later:
            print(f"removed {', '.join(p.name for p in later)}: written after {start.path.name} by an attempt this "
                  "run replaces")
        if root.is_dir() and start.path.parent == root:
            (root / "latest").write_text(source_checkpoint(start.path).name + "\n")
        restore_best(out, None if start.best_restarts else source_checkpoint(start.path))
        for name in END_OF_RUN:  # of the history this run replaces; written again at its end, or not at all
            remove(out / name)
        return
    doomed = EVALUATION_OUTPUTS if not training else RUN_OUTPUTS if overwrite else \
        [name for name in RUN_OUTPUTS if name != "checkpoints"]
    for name in doomed:
        remove(out / name)


def remove(target: Path) -> None:
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)


def source_checkpoint(path: Path) -> Path:
    """step_N for its universal conversion step_N.universal (recipes/checkpoints/elastic.py), else the path itself."""
    return path.with_name(path.name[:-len(".universal")]) if path.name.endswith(".universal") else path


def restore_best(out: Path, checkpoint_dir: Optional[Path]) -> None:
    """best/ as it was when `checkpoint_dir` was saved: the snapshot kept in it, or none when there was no best
    yet (or None: the best restarts). An abandoned attempt's later best (from evaluations after the checkpoint, no
    longer in eval.jsonl) goes."""
    shutil.rmtree(out / "best", ignore_errors=True)
    if checkpoint_dir is not None and (checkpoint_dir / "best").is_dir():
        link_tree(checkpoint_dir / "best", out / "best")


def link_tree(src: Path, dst: Path) -> None:
    """A copy of `src` at `dst` made of hard links where the filesystem allows (no bytes copied): the recipe only
    ever replaces these files (a new folder renamed over), never writes into them."""
    def link(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link)


def truncate_records(out: Path, step: int) -> None:
    """Drop metrics/eval lines written after the checkpoint by the interrupted run."""
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = out / name
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in kept))
