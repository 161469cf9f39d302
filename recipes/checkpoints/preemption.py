"""Preemption and the non-finite guard: what stops every rank together, at the same step.

How the ranks agree without a host read per step: each optimizer step already all-reduces a small tensor of the
step's loss sums (records.StepLog); two more entries ride on it, this rank's preemption vote and whether its gradient
norm was finite. The host reads that tensor only at a flush (every --logging_steps steps, and before every
evaluation, checkpoint and the end), where every rank sees the same reduced values and so takes the same decision:
- preemption: a SIGTERM or SIGUSR1 on any rank stops every rank at the flush that follows (at most --logging_steps
  optimizer steps later), which then writes a checkpoint of that step, the marker checkpoints/PREEMPTED, and exits
  with PREEMPTED_EXIT;
- a non-finite loss, or gradient norm, of a step that was not skipped on purpose (fp16 overflow steps are) stops
  every rank with one error line. Every checkpoint, evaluation and final/ comes after a flush, so none is ever
  written from weights that came after it.
"""
from __future__ import annotations

import math
import signal
import threading
from pathlib import Path
from typing import Optional

from recipes import RecipeError
from recipes.checkpoints import checkpoint

PREEMPTED_EXIT = 3  # exit status of a worker that stopped on a signal after writing its checkpoint: resume it

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

requested_signal: Optional[int] = None  # the stop signal this process received (module-wide: see probe.py's wait)


class Preempted(Exception):
    """Every rank stopped on a signal, after checkpoint `name`: the process exits with PREEMPTED_EXIT."""

def _on_signal(signum, frame) -> None:  # only a flag: the loop stops at the next flush, where the ranks agree
    global requested_signal
    requested_signal = signum

def install_signal_handlers() -> None:
    """SIGTERM (what SLURM, Kubernetes and torch's elastic agent send before a SIGKILL) and SIGUSR1 (SLURM's
    --signal=USR1@<seconds>, when it reaches the workers directly) ask for a checkpoint and a stop. Installed first
    thing in main, so that a signal during the data preparation is not the default's instant death; only Python's
    main thread may install handlers (an in-process harness running main in a thread keeps its own)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _on_signal)


class StepGuard:
    """The per-step votes of one run and the decisions every rank takes alike at a flush."""

    def __init__(self, start, out: Path):
        self.skipped_before = start.skipped_steps  # fp16 overflow steps counted up to the previous block
        self.last_checkpoint = str(start.path) if start.path else None
        self.preempted = 0  # how many ranks voted to stop, at the flush that saw the first vote; 0: none
        self.out = out

    @staticmethod
    def stop_vote() -> float:
        return 1.0 if requested_signal is not None else 0.0

    def check_block(self, block: list) -> None:
        """Called by StepLog.flush with (record, non-finite gradient norms, stop votes) per step, the same on every
        rank: raise on the first non-finite step, note an agreed preemption."""
        for record, bad_grads, votes in block:
            skipped = record["skipped_steps"] > self.skipped_before  # an fp16 overflow step: skipped by design
            self.skipped_before = record["skipped_steps"]
            if not skipped and (not math.isfinite(record["loss"]) or bad_grads):
                what = f"loss {record['loss']}" if not math.isfinite(record["loss"]) else "gradient norm"
                raise RecipeError(f"non-finite {what} at step {record['step']}: the run stopped before any later "
                                  f"checkpoint; last good checkpoint: {self.last_checkpoint or 'none'}")
            if votes and not self.preempted:
                self.preempted = votes

    def saved(self, path: Path) -> None:
        self.last_checkpoint = str(path)

    def leave_preempted(self, accelerator, checkpoint_name: str) -> None:
        if accelerator.is_main_process:
            (self.out / "checkpoints" / checkpoint.PREEMPTED_MARKER).write_text(checkpoint_name + "\n")
        accelerator.print(f"preempted (a stop signal on {self.preempted} of {accelerator.num_processes} ranks): "
                          f"checkpoint {checkpoint_name} written; run the same command with "
                          f"--resume_from_checkpoint auto to go on")
        raise Preempted(checkpoint_name)
