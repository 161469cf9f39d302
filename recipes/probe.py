"""For testing only: what the tests observe inside a run, and the faults they inject. Off by default.

One `Probe` per process. It does nothing unless `--record_ranks` (per-rank records) or the environment variable
`CLS_FAULT=<where>:<step>:<rank>` (SIGKILL that rank after optimizer step N, or while saving checkpoint N) asks for
it. The training loop calls it at three points: `batch` (each micro-batch), `step` (each optimizer step) and
`finish` (after training); `save_checkpoint` calls `saved`. Inert, each call returns at once and the batches carry no
sample ids.

With --record_ranks each rank writes ranks/rank<i>.json: the ids of the training examples it saw, micro-batch by
micro-batch; a float64 sum of each parameter as the rank holds it; the dtypes the first Linear computed in and the
optimizer's master weights and state are kept in; and the memory the rank holds (recipes/memstats.py).
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch

from recipes import memstats
from recipes.data import SAMPLE_IDS

FAULT_VARIABLE = "CLS_FAULT"


class Probe:
    def __init__(self, record: bool, rank: int, fault: str | None = None):
        self.record, self.rank, self.fault = record, rank, fault
        self.sample_ids: list[list[int]] = []
        self.forward_dtypes: dict = {}

    @classmethod
    def for_run(cls, cfg, rank: int) -> "Probe":
        return cls(record=cfg.record_ranks, rank=rank, fault=os.environ.get(FAULT_VARIABLE) or None)

    @property
    def wants_sample_ids(self) -> bool:
        return self.record

    def watch(self, model) -> None:
        """Remember, on the first forward, the dtype the first Linear computes in and the dtype of its weight then.

        Under FSDP2 the weight seen in forward is the gathered (bf16) copy, under DeepSpeed the engine's bf16 module,
        under autocast the fp32 parameter with a bf16 output: together they show what precision really ran.
        """
        if not self.record:
            return
        if torch.cuda.is_available():  # the peaks the record reports are those of training, not of loading
            torch.cuda.reset_peak_memory_stats()
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))

        def hook(module, inputs, output):
            self.forward_dtypes = {"forward_weight": str(module.weight.dtype), "forward_output": str(output.dtype)}
            handle.remove()

        handle = linear.register_forward_hook(hook)

    def batch(self, batch) -> None:
        """Take the example ids off a training micro-batch (a plain list beside the tensors) and keep them."""
        if self.record:
            self.sample_ids.append(batch.pop(SAMPLE_IDS))

    def step(self, step: int) -> None:
        self._maybe_die("step", step)

    def saved(self, step: int) -> None:
        """Called by save_checkpoint after this rank wrote its part of checkpoint `step`, before it is committed."""
        self._maybe_die("save", step)

    def _maybe_die(self, where: str, step: int) -> None:
        if self.fault is not None and self.fault == f"{where}:{step}:{self.rank}":
            os.kill(os.getpid(), signal.SIGKILL)

    def finish(self, out: Path, model, optimizer, device: torch.device) -> None:
        """Write this rank's record (see the module docstring)."""
        if not self.record:
            return
        sums = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
        folder = out / "ranks"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"rank": self.rank, "sample_ids": self.sample_ids, "param_sums": sums,
                  "dtypes": {**self.forward_dtypes, **optimizer_dtypes(optimizer)},
                  "memory": memstats.rank_memory(model, optimizer, device)}
        (folder / f"rank{self.rank}.json").write_text(json.dumps(record))


def optimizer_dtypes(optimizer) -> dict:
    """dtypes of the parameters the innermost torch optimizer updates (the master weights) and of its state."""
    inner = memstats.innermost_optimizer(optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    # DeepSpeed ZeRO-3 (0.19.8) empties param_groups outside its step; its fp32 partitions key the state then.
    params = params or [p for p in inner.state if torch.is_tensor(p)]
    states = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"master_params": sorted({str(p.dtype) for p in params}),
            "optimizer_state": sorted({str(t.dtype) for t in states})}
