"""Named points of a run where an observer may look in: for testing only. The test probe (recipes/testing/probe.py)
is the one observer, installed by cls.main when a test asks for it (testing/probe.py); with none installed a point
costs a dictionary lookup. The points, with what each passes:

- "started" (model, accelerator): the prepared model, before the first step
- "epoch" (epoch, loader): the loader an epoch iterates (a resumed epoch's skips its consumed micro-batches)
- "batch" (batch): each training micro-batch, before the forward
- "step" (step): after each optimizer step and its evaluation, before its checkpoint
- "trained" (out, model, optimizer, device): after the training loop
- "saved" (step): a rank has written its part of checkpoint `step`, before the checkpoint is committed
- "trial" (micro_batch): --auto_micro_batch's trial of a micro-batch, after its forward
"""
from __future__ import annotations

from typing import Callable

_observers: dict[str, list[Callable]] = {}


def observe(point: str, observer: Callable) -> Callable[[], None]:
    """Call `observer` at `point`; returns what removes it again."""
    _observers.setdefault(point, []).append(observer)
    return lambda: _observers[point].remove(observer)


def reached(point: str, *args) -> None:
    for observer in _observers.get(point, ()):
        observer(*args)
