"""make bench on a busy machine: how much CPU a measurement got, how much went to other work, and when it was disturbed.

Figures, per launch (scripts/measure/bench.py execute) and per block of the `alternate` run
(scripts/measure/bench_baselines.py Baton):
- CPU share: the CPU seconds of the run's processes / (wall seconds x its threads, threads per process x processes).
  A launch's processes are counted whole (getrusage of the children once they are reaped: start-up and evaluation
  included); an `alternate` block counts its process's CPU over the block's steps (time.process_time: the three
  sides take turns, so one side computes while the others wait).
- Others' share: the machine's busy CPU seconds (/proc/stat: user, nice, system, irq, softirq and steal, which is
  where a VM's neighbours show) less the run's own, over the machine's CPU seconds. For a launch the worst stretch as
  long as its timed epoch (`others_peak`, from samples every SAMPLE_S; a launch is 3-4x its epoch, and a disturbance
  of a few seconds averaged over the whole launch would hide), so a disturbance anywhere in the launch counts, even
  one during start-up: a needless repeat costs seconds, a missed one a wrong ratio.

The rule (disturbance, screen, screen_blocks): a measurement is disturbed when others' share exceeds OTHERS_CEILING
of the machine, or its CPU share falls below SHARE_FLOOR x the best share of the same kind of measurement in the same
bench: the same run (model and name) over its rounds and repeats, or the same `alternate` run's blocks. The best of
the same command is the calibration because that is what an undisturbed run of this kind reaches on this machine
today: multi-process runs wait in collectives and start-up is single-threaded, so no fixed share fits every kind, and
a calibration run at the start would cost a launch per kind and could itself be disturbed. The first run of a kind has
nothing to compare with yet while the bench runs; the final judgement (and --rerender) compares every run with the
best of all its kind's runs. The thresholds are taken at face value: above 0.10 others' load a 2-core machine has lost
a fifth of a core to other work, several times the daemons' own share of an idle VM; a run at 0.85 of its best lost
about 15% of its CPU, far more than the 2-3% the ratios resolve.
"""
from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path
from typing import Optional

SHARE_FLOOR = 0.85  # below this fraction of its kind's best CPU share, a measurement lost its CPU to other work
OTHERS_CEILING = 0.10  # others' CPU above this share of the machine disturbs a measurement
MAX_REPEATS = 2  # a disturbed COMPARED run is launched again at most this many times; still disturbed: set aside
SAMPLE_S = 0.5  # seconds between samples of a launch's CPU and the machine's


def machine_cpu() -> Optional[tuple[float, float]]:
    """(busy, all) CPU seconds of the whole machine since boot, from /proc/stat's first line; None without one.
    Busy: user, nice (guest time is inside these), system, irq, softirq and steal; all adds idle and iowait."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    hz = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    return busy / hz, (busy + idle + iowait) / hz


def tree_cpu(root: int) -> dict:
    """CPU seconds so far of `root` and its live descendants, by pid, from /proc/<pid>/stat; {} without /proc."""
    parents, cpu = {}, {}
    hz = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited since the listing
        parents[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / hz
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in cpu and pid not in tree:
            tree[pid] = cpu[pid]
            todo += [child for child, parent in parents.items() if parent == pid]
    return tree


def children_cpu() -> float:
    """CPU seconds of every child this process has reaped, and of theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class LaunchMeter:
    """The CPU of one launched process tree and of the machine beside it, from start(pid) to stop() (after the
    process is reaped). samples: (seconds since start, the tree's CPU seconds, machine busy, machine all)."""

    def __init__(self):
        self.samples: list = []
        self._done = threading.Event()
        self._thread = None
        self._pids: dict = {}  # pid: CPU seconds at its last sample, so a process that exits takes its CPU along

    def start(self, pid: int) -> None:
        self._t0, self._children0, self._pid = time.perf_counter(), children_cpu(), pid
        self._own = 0.0
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self, own: Optional[float] = None) -> None:
        machine = machine_cpu()
        if own is None:
            now = tree_cpu(self._pid)
            self._own += sum(cpu - self._pids.get(pid, 0.0) for pid, cpu in now.items())
            self._pids.update(now)
            own = self._own
        if machine is not None:
            self.samples.append((time.perf_counter() - self._t0, own, *machine))

    def _loop(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self._sample()

    def stop(self) -> float:
        """The tree's CPU seconds, exact: from the kernel's accounts of the reaped processes."""
        self._done.set()
        self._thread.join()
        cpu = children_cpu() - self._children0
        self._sample(own=max(cpu, self._own))
        return cpu


def others_share(samples: list, window_s: Optional[float] = None) -> Optional[float]:
    """Others' CPU / the machine's over the samples, or its worst over stretches of at least `window_s` seconds."""
    if len(samples) < 2:
        return None

    def share(a, b):
        machine = b[3] - a[3]
        return max(0.0, (b[2] - a[2]) - (b[1] - a[1])) / machine if machine > 0 else 0.0

    if not window_s or samples[-1][0] - samples[0][0] <= window_s:
        return share(samples[0], samples[-1])
    worst = 0.0
    for i, a in enumerate(samples):
        b = next((b for b in samples[i + 1:] if b[0] - a[0] >= window_s), None)
        if b is None:
            break
        worst = max(worst, share(a, b))
    return worst


def kind(run: dict) -> tuple:
    return run["model"], run["name"]


def label(run: dict) -> str:
    """name#round, and the attempt where it is a repeat: grouped#2, grouped#2 (repeat 1)."""
    text = f"{run['name']}#{run.get('round', 0)}"
    return text + (f" (repeat {run['attempt']})" if run.get("attempt") else "")


def judge(share: Optional[float], others: Optional[float], best: Optional[float]) -> str:
    """Why a measurement counts as disturbed, '' when it does not (or has no figures)."""
    reasons = []
    if others is not None and others > OTHERS_CEILING:
        reasons.append(f"others' CPU {others:.2f} of the machine > {OTHERS_CEILING}")
    if share is not None and best and share < SHARE_FLOOR * best:
        reasons.append(f"CPU share {share:.2f} < {SHARE_FLOOR} x {best:.2f}")
    return ", ".join(reasons)


def disturbance(run: dict, runs: list) -> str:
    """Why a finished run counts as disturbed, against the best CPU share of its kind among `runs` (and itself)."""
    if run.get("status") != "ok":
        return ""
    shares = [r["cpu_share"] for r in [*runs, run]
              if kind(r) == kind(run) and r.get("status") == "ok" and r.get("cpu_share") is not None]
    others = run.get("others_peak") if run.get("others_peak") is not None else run.get("others_share")
    return judge(run.get("cpu_share"), others, max(shares, default=None))


def screen(runs: list) -> dict:
    """The runs that count, and those set aside: `repeated`, an attempt that a later launch of the same run and round
    replaced, and `disturbed`, the last attempt still disturbed, as (run, why) pairs."""
    last = {}
    for r in runs:
        key = (*kind(r), r.get("round", 0))
        if r.get("attempt", 0) >= last.get(key, {}).get("attempt", -1):
            last[key] = r
    kept, repeated, disturbed = [], [], []
    for r in runs:
        if last[(*kind(r), r.get("round", 0))] is not r:
            repeated.append((r, disturbance(r, runs) or "repeated"))
            continue
        kept.append(r)
        why = disturbance(r, runs)
        if why:
            disturbed.append((r, why))
    return {"kept": kept, "repeated": repeated, "disturbed": disturbed}


def block_figures(block: dict, threads: int) -> tuple:
    """(CPU share, others' share) of one `alternate` block; (None, None) for a block recorded without them."""
    if block.get("cpu_s") is None:
        return None, None
    share = block["cpu_s"] / (block["wall_s"] * threads) if block["wall_s"] > 0 else None
    others = max(0.0, block["machine_busy_s"] - block["cpu_s"]) / block["machine_s"] if block["machine_s"] else None
    return share, others


def screen_blocks(blocks: list, threads: int) -> tuple[list, list]:
    """(kept blocks, [(block, why)] set aside) of one `alternate` run, each judged against its best block."""
    figures = [block_figures(b, max(1, threads)) for b in blocks]
    best = max((share for share, _ in figures if share is not None), default=None)
    kept, aside = [], []
    for block, (share, others) in zip(blocks, figures):
        why = judge(share, others, best)
        if why:
            aside.append((block, why))
        else:
            kept.append(block)
    return kept, aside
