"""The recipe's host work per training step, piece by piece, against what a hand-written loop does instead.

    python scripts/measure/bench_host.py        # about 20 seconds on 2 CPU cores

Each piece is timed with `timeit` (the median of --repeat runs of --number calls) on a model of 18 parameters and
batches already in memory, so that nothing but the bookkeeping runs: the recipe's `StepLog` (recipes/outputs/
records.py) at `--logging_steps 1` as `make bench` runs it, TensorBoard included, and apart from it the one
`accelerator.log` call per step that reaches TensorBoard; against them the hand-written loop's record; and
Accelerate's wrappers of the optimizer, the scheduler, the loader and `accumulate`, each as the difference from the
plain object it wraps.
docs/speed.md ("Per step") quotes a run; the recipe's step on the tiny model takes about 80 ms, so 1 ms is 1.2%.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import timeit
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import is_lomo_available
from tqdm.auto import tqdm

from recipes.outputs import records
from recipes.training import optimizer_step


def pieces(number: int = 2000, repeat: int = 7, folder: Path | None = None) -> dict:
    """Microseconds per call of each piece (a difference where it says "over"); the StepLog's records and the
    TensorBoard events go to `folder` (a new temporary folder by default)."""
    def per_call(fn, calls: int = number) -> float:
        return statistics.median(timeit.repeat(fn, number=calls, repeat=repeat)) / calls * 1e6

    folder = Path(folder or tempfile.mkdtemp(prefix="bench_host_"))
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(folder))
    accelerator.init_trackers("host")
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batches = [{"input_ids": torch.randint(0, 100, (16, 40)), "attention_mask": torch.ones(16, 40, dtype=torch.long)}
               for _ in range(1000)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    p_model, p_optimizer, p_loader, p_scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    loss, grad_norm, batch = torch.tensor(0.7), torch.tensor(1.0), batches[0]

    def step_log(log):
        step = [0]

        def one():
            step[0] += 1
            log.add(loss, batch)
            log.end_step({"step": step[0], "epoch": 0, "lr": 1e-3, "samples": 16, "skipped_steps": 0,
                          "elapsed": 0.0}, grad_norm)
        return one

    def loop_record():  # what the hand-written loop logs (scripts/measure/bench_baselines.py hand_loop)
        return {"loss": loss.item(), "tokens": int(batch["attention_mask"].sum()),
                "padded_tokens": batch["attention_mask"].numel()}

    def accumulate():
        with accelerator.accumulate(p_model):
            pass

    progress = tqdm(disable=True)
    out = {
        "StepLog, TensorBoard on": per_call(step_log(records.StepLog(accelerator, folder / "metrics.jsonl", 1,
                                                                     progress))),
        "accelerator.log, 3 scalars to TensorBoard": per_call(
            lambda: accelerator.log({"a": 1.0, "b": 2.0, "c": 3.0}, step=1)),
        "the loop's record": per_call(loop_record),
        "AcceleratedOptimizer step + zero_grad, over the optimizer's": (
            per_call(lambda: (p_optimizer.step(), p_optimizer.zero_grad(set_to_none=False)))
            - per_call(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=False)))),
        "is_lomo_available (twice in each AcceleratedOptimizer.step)": per_call(is_lomo_available),
        "the prepared loader per batch, over the loader's": (
            per_call(lambda: list(p_loader), 3) - per_call(lambda: list(loader), 3)) / len(batches),
        "accelerator.accumulate": per_call(accumulate),
        "AcceleratedScheduler step + get_last_lr, over the scheduler's": (
            per_call(lambda: (p_scheduler.get_last_lr(), p_scheduler.step()))
            - per_call(lambda: (scheduler.get_last_lr(), scheduler.step()))),
        "optimizer_step.clip_gradients, over clip_grad_norm_": (
            per_call(lambda: optimizer_step.clip_gradients(accelerator, p_model, 1.0))
            - per_call(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))),
    }
    accelerator.end_training()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings per piece; the median is reported")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    for name, us in pieces(args.number, args.repeat).items():
        print(f"{us:8.1f} us  {name}")


if __name__ == "__main__":
    main()
