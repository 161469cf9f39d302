"""tests/prewarm.py, the test machinery that forks launches from a process that imported the stack once: a forked
launch trains exactly as a fresh one, what a fork cannot honour starts fresh, and the shim passes on exit codes,
signals and kills."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import prewarm
from helpers import PARITY_FLAGS, PYTHON, REPO, losses, rank_records, run_recipe


def server_log() -> Path:
    """The running server's log, once its socket accepts (its imports take about 10 s)."""
    if os.environ.get("RECIPE_TEST_PREWARM", "0") == "0":
        pytest.skip("RECIPE_TEST_PREWARM=0: no server in this run")
    socket_path = Path(os.environ["RECIPE_TEST_PREWARM"])
    deadline = time.monotonic() + 120
    while not socket_path.exists():
        assert time.monotonic() < deadline, "the prewarm server did not open its socket within 120 s"
        time.sleep(0.5)
    return Path(os.environ.get("RECIPE_TEST_PREWARM_LOG", socket_path.parent / "log"))


def lines(log: Path) -> list[str]:
    """The log's lines about this test's requests (the server names the test that asked: prewarm.asked_by), without
    that name."""
    mine = f" [{os.environ['PYTEST_CURRENT_TEST'].rsplit(' (', 1)[0]}]"
    return [line.replace(mine, "", 1) for line in (log.read_text().splitlines() if log.exists() else [])
            if mine in line]


@pytest.mark.parametrize("config,forks", [("ddp.yaml", {"deepspeed fork": 1, "fork": 2}),
                                          ("zero2.yaml", {"deepspeed fork": 3})])
def test_a_forked_launch_trains_exactly_as_a_fresh_one(tiny_model, tmp_path, config, forks):
    """2 processes, 8 steps with every rank's state recorded: the launcher and both ranks forked (the launcher by the
    DeepSpeed server, the ranks by the server their strategy takes: the log names each), then the same run with the
    server switched off for it; per-step losses and every rank's parameter sums after training and sample ids are
    equal."""
    log = server_log()
    before = len(lines(log))
    run_recipe(tmp_path / "forked", *PARITY_FLAGS, config=config)
    new = [line.split(" /")[0].split(" -")[0] for line in lines(log)[before:]]
    assert {kind: new.count(kind) for kind in forks} == forks, lines(log)[before:]
    run_recipe(tmp_path / "fresh", *PARITY_FLAGS, config=config, env={"RECIPE_TEST_PREWARM": "0"})
    assert len(losses(tmp_path / "forked")) == 8
    assert losses(tmp_path / "forked") == losses(tmp_path / "fresh")
    for key in ("param_sums", "sample_ids"):
        assert [r[key] for r in rank_records(tmp_path / "forked")] == [r[key] for r in rank_records(tmp_path / "fresh")]


def test_what_a_fork_cannot_honour_starts_fresh():
    """Interpreter flags other than -u/-m/-c, and variables read at import time, are refused; the launchers'
    per-rank variables and what the imports set are not."""
    assert prewarm.interpreter_args(["-u", "recipes/cls.py", "--x"]) == (
        {"unbuffered": True, "module": None, "code": None}, ["recipes/cls.py", "--x"])
    assert prewarm.interpreter_args(["-m", "torch.distributed.run", "-h"])[0]["module"] == "torch.distributed.run"
    assert prewarm.interpreter_args(["-X", "importtime", "a.py"]) is None
    assert prewarm.interpreter_args(["-u"]) is None
    base = {"HOME": "/root", "HF_HOME": "/a"}
    launch = {**base, "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "ACCELERATE_MIXED_PRECISION": "no",
              "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/t"}
    assert prewarm.import_time_differences(launch, base, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/t"}) == []
    assert prewarm.import_time_differences({**launch, "HF_HOME": "/b", "GOMP_CPU_AFFINITY": "0"}, base,
                                           {"TORCHINDUCTOR_CACHE_DIR": "/tmp/t"}) == ["GOMP_CPU_AFFINITY", "HF_HOME"]
    assert prewarm.import_time_differences({"HOME": "/root"}, base) == ["HF_HOME"]


def test_the_shim_waits_for_a_starting_server_and_only_for_one(tmp_path):
    """While the server named in RECIPE_TEST_PREWARM_SERVER runs and its socket has not appeared, the shim waits; once
    that process has exited (a zombie counts as exited), or with no server named, it runs the real python at once."""
    path = tmp_path / "shim"
    path.write_text(prewarm.SHIM.format(python=PYTHON))
    path.chmod(0o755)
    stand_in = subprocess.Popen(["sleep", "30"])  # a "server" that never opens its socket
    env = {**os.environ, "RECIPE_TEST_PREWARM": str(tmp_path / "socket"),
           "RECIPE_TEST_PREWARM_SERVER": str(stand_in.pid)}
    try:
        started = time.monotonic()
        waiting = subprocess.Popen([str(path), "-c", "print('ran')"], stdout=subprocess.PIPE, text=True, env=env)
        time.sleep(2)
        assert waiting.poll() is None  # still waiting for the socket
        stand_in.kill()  # exits, unreaped for a moment: a zombie
        out, _ = waiting.communicate(timeout=60)
        assert out == "ran\n" and waiting.returncode == 0 and time.monotonic() - started >= 2
    finally:
        stand_in.kill()
        stand_in.wait()
    for server in ("", str(stand_in.pid)):  # none named, or one that has exited: no wait
        started = time.monotonic()
        proc = subprocess.run([str(path), "-c", "print('ran')"], capture_output=True, text=True,
                              env={**env, "RECIPE_TEST_PREWARM_SERVER": server}, timeout=60)
        assert proc.stdout == "ran\n" and time.monotonic() - started < 10, (server, proc.stderr)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    stat = prewarm.proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def shim(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([os.environ["RECIPE_TEST_PREWARM_PYTHON"], *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_the_shim_passes_on_exit_codes_signals_and_kills(tmp_path):
    """A fork's exit code and the signal that killed it come back as the shim's; a signal sent to the shim reaches
    the fork; a SIGKILLed shim takes its fork (and what the fork started) with it."""
    log = server_log()
    before = len(lines(log))
    proc = shim("-c", "import sys, torch; print(torch.__version__); sys.exit(3)")
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out.strip()) == (3, str(__import__("torch").__version__))
    proc = shim("-c", "import os, signal; os.kill(os.getpid(), signal.SIGUSR1)")
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGUSR1
    # a SIGTERM to the shim reaches the fork's own handler
    ready = tmp_path / "ready"
    proc = shim("-c", "import signal, sys, time, pathlib\n"
                      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
                      f"pathlib.Path({str(ready)!r}).write_text('x')\n"
                      "time.sleep(60)")
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 7
    # SIGKILL of the shim: the fork and the process it started are killed by the server
    pids = tmp_path / "pids"
    proc = shim("-c", "import os, subprocess, sys, time, pathlib\n"
                      f"child = subprocess.Popen([{PYTHON!r}, '-c', 'import time; time.sleep(60)'])\n"
                      f"pathlib.Path({str(pids)!r}).write_text(f'{{os.getpid()}} {{child.pid}}')\n"
                      "time.sleep(60)", start_new_session=True)
    deadline = time.monotonic() + 30
    while not pids.exists() or len(pids.read_text().split()) != 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    fork, child = map(int, pids.read_text().split())
    assert fork != proc.pid
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in (fork, child)):
        assert time.monotonic() < deadline, f"fork {fork} or its child {child} outlived the killed shim"
        time.sleep(0.1)
    assert sum(line.startswith("fork -c ") for line in lines(log)[before:]) == 4  # none of the four started fresh
