"""Stopping a launch for good: the launcher's process group and every process below it.

The bench, the GPU check and the tests start each `accelerate launch` with start_new_session=True and kill its process
group at a time limit. That group holds the launcher only: torchrun (torch 2.13.0,
torch/distributed/elastic/multiprocessing/subprocess_handler) starts every rank with start_new_session=True too, and a
SIGKILL cannot be forwarded, so the ranks of a killed launcher lived on, orphaned: a rank hung in a collective kept
its cores and port, and a reader of the launcher's output pipe (`communicate`) waited on it for ever. psutil comes
with accelerate (a dependency of accelerate 1.15.0).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` (started with start_new_session=True), its group and all its descendants, then reap it."""
    kill_tree(proc.pid)
    proc.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL the session leader `pid`, its group and all its descendants (the caller reaps `pid`)."""
    try:
        below = psutil.Process(pid).children(recursive=True)  # listed first: orphans have no parent to list
    except psutil.NoSuchProcess:
        below = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
