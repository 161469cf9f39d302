"""--auto_micro_batch: the largest per-device micro-batch that fits in memory, found before training, with the
gradient accumulation raised so that the global batch, and so the training, stays what was asked.

Candidates: the divisors of the samples a rank trains on per optimizer step (--per_device_train_batch_size x
--gradient_accumulation_steps), largest first, none above the asked micro-batch: with micro-batch m the accumulation
is samples / m, and the even-shard sampler deals the same samples to each optimizer step (recipes/inputs/data.py), so a
run that chose m trains exactly as a run started with `--per_device_train_batch_size m`.

The trial, on every rank: a forward and backward of the longest possible batch (m x --max_length tokens, rounded up
to --pad_to_multiple_of) through the model on this rank's device, under the run's autocast, before
`accelerator.prepare`. Why before: the prepared model would join collectives in backward (DDP's all-reduce, ZeRO's
reduce-scatter), where a rank that ran out of memory would leave the others waiting; and DeepSpeed reads the
micro-batch and accumulation once, inside prepare. So each rank tries alone, and the ranks then agree on the
smallest of their largest fitting sizes (one gather, every rank's trials recorded). What prepare adds later is not in
the trial: the optimizer's state, DDP's buckets; ZeRO and FSDP shard what the trial holds whole, and DeepSpeed's bf16
computes in half the bytes of the trial's fp32. The trial leaves the run as it found it: no optimizer step,
gradients dropped, buffers and the CPU and CUDA RNG states (dropout) put back, the model back on its device.

A resumed run on the same world size and global batch keeps the split its checkpoint was written with
(trainer_state.json), without a trial: it continues the uninterrupted run's micro-batches, whatever memory it finds.
"""
from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import asdict

import torch

from recipes import RecipeError, hooks
from recipes.checks import launch_checks

# torch 2.13.0 raises torch.OutOfMemoryError (alias torch.cuda.OutOfMemoryError) on a GPU; the CPU allocator raises
# a plain RuntimeError with this text.
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"


def candidates(micro: int, accum: int) -> list[int]:
    """The micro-batches tried, largest first: divisors of micro x accum, none above micro."""
    samples = micro * accum
    return [m for m in range(micro, 0, -1) if samples % m == 0]


def out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and CPU_OUT_OF_MEMORY in str(err))


def longest_batch(cfg) -> int:
    """The padded length of the longest batch the collator can make (recipes/inputs/data.py Collator)."""
    multiple = cfg.pad_to_multiple_of or 1
    return -(-cfg.max_length // multiple) * multiple


def fits(model, size: int, length: int, device, autocast=contextlib.nullcontext) -> bool:
    """Whether a forward and backward of `size` x `length` tokens runs on `device`; False on out-of-memory only.

    The tensors of a failed trial live in this frame (and the exception's traceback): they are freed once it returns.
    """
    token = ((model.config.pad_token_id or 0) + 1) % model.config.vocab_size  # not padding: every position computes
    input_ids = torch.full((size, length), token, dtype=torch.long, device=device)
    try:
        with autocast():
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
        hooks.reached("trial", size)  # for testing only: an out-of-memory error the test probe injects
        logits.float().sum().backward()
        return True
    except RuntimeError as err:
        if not out_of_memory(err):
            raise
        return False
    finally:
        model.zero_grad(set_to_none=True)


def release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def largest_fitting(model, sizes: list[int], length: int, device, autocast=contextlib.nullcontext) -> list:
    """This rank's trials, largest first, up to the first size that fits: [(size, fits), ...]. The model, its
    buffers, its mode, its device and the RNG states are as before."""
    home = next(model.parameters()).device
    was_training = model.training
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    model.to(device)
    model.train()  # dropout masks are kept for backward: the training's memory
    tried = []
    try:
        for size in sizes:
            ok = fits(model, size, length, device, autocast)
            release(device)
            tried.append((size, ok))
            if ok:
                break
    finally:
        model.train(was_training)
        model.to(home)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        release(device)
    return tried


def kept_from_checkpoint(start, sizes: list[int], samples: int, world: int) -> int:
    """The checkpoint's micro-batch when this run continues its split (same world size and global batch), else 0."""
    if start.path is None or start.world_size != world or start.global_batch != samples * world:
        return 0
    return start.per_device_train_batch_size if start.per_device_train_batch_size in sizes else 0


def fit(cfg, accelerator, model, start) -> dict | None:
    """With --auto_micro_batch, choose the micro-batch (a collective: every rank calls it) and set it as
    cfg.per_device_train_batch_size, the accumulation as cfg.gradient_accumulation_steps and the Accelerator's;
    returns what run_config.json records. None without the flag."""
    if not cfg.auto_micro_batch:
        return None
    asked_micro, asked_accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    world = accelerator.num_processes
    samples, sizes, length = asked_micro * asked_accum, candidates(asked_micro, asked_accum), longest_batch(cfg)
    micro, trials = kept_from_checkpoint(start, sizes, samples, world), []
    if not micro:
        if any(hasattr(p, "ds_shape") or p.is_meta for p in model.parameters()):  # partitioned, or not loaded here
            raise RecipeError("--auto_micro_batch tries the whole model on each device before accelerator.prepare: "
                              "not with ZeRO-3's zero3_init_flag or FSDP's cpu_ram_efficient_loading, which leave a "
                              "rank without it; give --per_device_train_batch_size yourself or turn them off")
        trials = agreed_trials(model, sizes, length, accelerator)
        micro = min(max((s for s, ok in tried if ok), default=0) for tried in trials)
        if not micro:
            failed = [rank for rank, tried in enumerate(trials) if not any(ok for _, ok in tried)]
            raise RecipeError(f"--auto_micro_batch: a micro-batch of 1 x {length} tokens runs out of memory on rank(s) "
                              f"{', '.join(map(str, failed))}; lower --max_length, add --gradient_checkpointing or "
                              "shard the model (FSDP, ZeRO-3)")
    accum = samples // micro
    cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps = micro, accum
    # Accelerate 1.15.0 fills DeepSpeed's "auto" gradient_accumulation_steps from the Accelerator's inside prepare;
    # train_micro_batch_size_per_gpu comes from cfg (strategy.fill_deepspeed_auto).
    accelerator.gradient_accumulation_steps = accum
    problems = launch_checks.check_launch_env(dict(os.environ), asdict(cfg))  # a DeepSpeed JSON that fixes them
    if problems:
        raise RecipeError(f"--auto_micro_batch chose micro-batch {micro} x accumulation {accum}, which the launch "
                          f"config refuses: {'; '.join(problems)}")
    accelerator.print(f"--auto_micro_batch: micro-batch {micro} x accumulation {accum} per device (asked "
                      f"{asked_micro} x {asked_accum})" + ("" if trials else f", kept from {start.path}"))
    return {"asked_micro_batch": asked_micro, "asked_accumulation": asked_accum, "micro_batch": micro,
            "gradient_accumulation_steps": accum, "candidates": sizes, "sequence_length": length,
            "source": "search" if trials else "checkpoint",
            "trials": [[{"micro_batch": s, "fits": ok} for s, ok in tried] for tried in trials]}


def agreed_trials(model, sizes: list[int], length: int, accelerator) -> list[list]:
    """Every rank's trials, by rank. A rank whose trial fails for another reason than memory raises its error, and
    the others a RecipeError naming it, all after the gather: no rank is left waiting in a collective."""
    error = None
    try:
        tried = largest_fitting(model, sizes, length, accelerator.device, accelerator.autocast)
    except Exception as err:  # noqa: BLE001 - re-raised below, once every rank knows
        tried, error = [], err
    mine = (tried, None if error is None else f"{type(error).__name__}: {error}")
    if accelerator.num_processes == 1:
        verdicts = [mine]
    else:
        from accelerate.utils import gather_object

        verdicts = gather_object([mine])
    if error is not None:
        raise error
    failed = [(rank, why) for rank, (_, why) in enumerate(verdicts) if why]
    if failed:
        raise RecipeError(f"--auto_micro_batch: the trial failed on rank {failed[0][0]}: {failed[0][1]}")
    return [tried for tried, _ in verdicts]


def describe(choice: dict | None, accelerator) -> dict:
    """The run_config.json entry (empty without --auto_micro_batch); under DeepSpeed, the sizes its engine got."""
    if choice is None:
        return {}
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        choice = {**choice, "deepspeed": {key: plugin.deepspeed_config.get(key) for key in (
            "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")}}
    return {"auto_micro_batch": choice}
