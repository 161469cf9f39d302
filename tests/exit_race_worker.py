"""Launched by tests/test_gpu_readiness.py with torchrun on 2 processes; not a test module itself.

The end of a run as DeepSpeed leaves it, in miniature: a gloo process group that a module keeps (DeepSpeed keeps its
groups in deepspeed.utils.groups), a last all-gather on it whose Python tensors are dropped at once, then the exit.
Usage: exit_race_worker.py [--plain]; --plain returns normally (interpreter finalization: the aborts this guards
against), by default the process leaves through recipes.training.process.exit_process, as recipes/cls.py does.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from recipes.training import process

dist.init_process_group("gloo")
KEPT = dist.new_group([0, 1])
gathered = [torch.empty(1000) for _ in range(2)]
dist.all_gather(gathered, torch.full((1000,), float(dist.get_rank())), group=KEPT, async_op=True).wait()
del gathered
if "--plain" not in sys.argv:
    process.exit_process(0)
