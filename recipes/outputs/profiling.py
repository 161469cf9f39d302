"""`--profile_steps A-B`: optimizer steps A..B (counted from 1, as in metrics.jsonl) recorded with torch.profiler.

Every rank records its own trace; the files go to <output_dir>/profile/: `trace_rank<i>.json` (Chrome trace, for
chrome://tracing or Perfetto) and `tensorboard/rank<i>.*.pt.trace.json` (TensorBoard's profiler plugin). Each step is
one `record_function` range named `optimizer_step_<n>`, from its first micro-batch's forward to the end of its
optimizer and scheduler step, so its forward, backward and optimizer ops sit inside it whatever the strategy (under
DeepSpeed the engine steps inside the last micro-batch's `accelerator.backward`).

The profiler is started with the first micro-batch of step A and stopped after step B, explicitly rather than with a
`schedule`: a resumed run starts at any step, and nothing before A (data loading of earlier steps) or after B
(evaluation, checkpoints, the next step's forward) enters the trace. Off (the default), each call returns at once.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

from recipes import RecipeError

STEP_MARK = "optimizer_step_{}"


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """`A-B` -> (A, B) with 1 <= A <= B; None when not given; ValueError for anything else."""
    if text is None:
        return None
    first, sep, last = text.partition("-")
    if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise ValueError(text)
    return int(first), int(last)


def steps_problem(text: str | None, total_steps: int | None) -> str | None:
    """The flag's one problem line, or None; `total_steps` is the run's step count where it is known."""
    try:
        steps = parse_steps(text)
    except ValueError:
        return f"--profile_steps '{text}' must be A-B with 1 <= A <= B (optimizer steps, e.g. 3-5)"
    if steps and total_steps is not None and steps[1] > total_steps:
        return f"--profile_steps {text} goes beyond the run's {total_steps} optimizer steps"
    return None


class StepProfiler:
    """What the training loop calls: `batch(step)` before each micro-batch (`step` optimizer steps done so far) and
    `step(step)` after each optimizer step; `finish()` after the loop, for a run that ended before step B."""

    def __init__(self, text: str | None, out_dir: Path, rank: int, total_steps: int):
        problem = steps_problem(text, total_steps)
        if problem:  # --max_train_steps absent: the step count is only known once the data are planned
            raise RecipeError(problem)
        self.steps = parse_steps(text)
        self.out_dir, self.rank = Path(out_dir), rank
        self.prof: profile | None = None
        self.mark: record_function | None = None

    def batch(self, step: int) -> None:
        """Opens step `step + 1`'s range at its first micro-batch; later micro-batches of the step find it open."""
        if self.steps is None or self.mark is not None or not self.steps[0] <= step + 1 <= self.steps[1]:
            return
        if self.prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            handler = tensorboard_trace_handler(str(self.out_dir / "tensorboard"), worker_name=f"rank{self.rank}")
            self.prof = profile(activities=activities, on_trace_ready=handler, record_shapes=True)
            self.prof.start()
        self.mark = record_function(STEP_MARK.format(step + 1))
        self.mark.__enter__()

    def step(self, step: int) -> None:
        """Closes the range of step `step`, just done; after step B the traces are written."""
        if self.mark is None:
            return
        self.mark.__exit__(None, None, None)
        self.mark = None
        if step >= self.steps[1]:
            self.finish()

    def finish(self) -> None:
        if self.prof is None:
            return
        if self.mark is not None:  # a run that stopped inside a step (early stopping never does; kept safe)
            self.mark.__exit__(None, None, None)
            self.mark = None
        self.prof.stop()  # without a schedule, stop() hands the trace to on_trace_ready: the TensorBoard file
        self.prof = None
        # torch 2.13.0 saves a trace once ("Trace is already saved" on a second export_chrome_trace), and the
        # TensorBoard file is itself a Chrome trace: the Chrome trace is a copy of it, under a name without a time.
        written = sorted((self.out_dir / "tensorboard").glob(f"rank{self.rank}.*.pt.trace.json"),
                         key=lambda path: path.stat().st_mtime_ns)
        shutil.copyfile(written[-1], self.out_dir / f"trace_rank{self.rank}.json")
