"""Test machinery: launches whose Python processes fork from one that imported the stack once.

A tiny launch costs 12-35 CPU-seconds, and most of it is imports: 7.7 s a rank (torch, transformers, scipy under
evaluate) and 3.7 s for `accelerate launch` itself, measured on the 2-core CI machine (results/
2026-11-29_test_suite_cpu_vm.md). `make test` makes about 230 launches. Here each pytest worker starts one server
that imports torch, transformers, accelerate, datasets, evaluate and the recipe once; a launch then runs its launcher
and its ranks in processes forked from that server, each running the real `accelerate launch` and `recipes/cls.py`.

How a process gets forked instead of started: `run_recipe` (helpers.py) calls a small stand-in for python (the shim,
written at start with this interpreter in its first line). The shim sends the server its command line, environment,
working folder and its stdin/stdout/stderr; the server forks; the fork takes those as its own and runs the script as
`__main__` the way `python script.py` would, then exits through the interpreter's own shutdown. A forked launcher
sees the shim as `sys.executable`, so the ranks it starts (accelerate's simple launcher, torchrun's agent) come back
through the shim as well, as do scripts/sweep.py's trials. The shim forwards the signals it receives to its fork and
exits as the fork did (the same code, or killed by the same signal); when the shim dies (SIGKILL at a test's time
limit), the server kills its fork and everything below it (`scripts/measure/processes.kill_tree`, what `kill_launch`
does to a real launch).

DeepSpeed launches fork from a second server, forked from the first once it has imported the stack, that has also
imported what a DeepSpeed rank imports (deepspeed, with mlflow hidden as recipes/workarounds/deepspeed.py does, and
the modules `deepspeed.initialize` pulls in: torch's inductor and dynamo for its Muon optimizer) and what `accelerate
launch` imports for a DeepSpeed config (deepspeed's launcher). Measured on top of the first server's imports: 1.9
CPU-seconds a ZeRO rank (deepspeed 0.36, the Muon module 1.57) and 2.2 a DeepSpeed launcher (deepspeed with mlflow);
a tiny ZeRO-2 test alone took 47 s instead of 53. The first server hands the DeepSpeed server the shim's request (with
the shim's connection and streams) when it is a DeepSpeed rank's (ACCELERATE_USE_DEEPSPEED=true, set by accelerate's
launcher, and no "mlflow" in its command line: a run that logs to MLflow imports deepspeed with it, as it would) or
`accelerate launch`'s (a launcher of another strategy never looks at deepspeed). The other processes fork from the
first server, where deepspeed is not imported, as in a fresh run. The one line deepspeed logs at import ("Setting
accelerator to CPU") goes to the servers' log instead of the rank's output: no test reads it.

What a fork cannot take over from a fresh interpreter, it does not: a command with an interpreter flag other than
-u, -m or -c, or an environment that differs from the server's in a variable read at import time (anything outside
LAUNCH_VARIABLES below: HF_*, GOMP_*, a test's own settings), is answered "exec" and the shim execs the real python.
OMP_NUM_THREADS, which libgomp reads when it loads, is applied with torch.set_num_threads in the fork. A rank's
parent, read by the recipe from /proc (launch_checks.launch_request), is the shim of its launcher: os.getppid in a fork
returns that pid. Switch it all off with RECIPE_TEST_PREWARM=0.
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from scripts.measure import processes

# Variables a launch sets or a test run changes that no imported module reads at import time: a fork may differ
# from the server in these (accelerate 1.15.0 and torch 2.13.0's launchers set them for each rank; a DeepSpeed launch
# also sets what `import deepspeed` sets, and PYTHONPATH, whose new entries a fork puts on its import path as python
# would).
# CUDA_VISIBLE_DEVICES is read when CUDA starts, which the server never does: it serves only where no GPU is visible.
# torchrun's own (PET_*: its arguments as variables; TORCH_DISABLE_SHARE_RDZV_TCP_STORE, read by its rendezvous).
# Three that imports in a pytest worker set and its launches inherit: KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK
# (sklearn, joblib, threadpoolctl; read by Intel's OpenMP runtime, which torch's CPU wheel does not load) and inductor's
# _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR (read by code inductor compiles, at run time, after it sets it itself).
LAUNCH_VARIABLES = re.compile(
    r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_NAME|ROLE_WORLD_SIZE"
    r"|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|TORCH_NCCL_\w+|NCCL_\w+|ACCELERATE_\w+|FSDP_\w+|OMP_NUM_THREADS"
    r"|PYTHONUNBUFFERED|PYTHON_EXEC|PYTEST_CURRENT_TEST|PYTEST_XDIST_\w+|COLUMNS|LINES|SHLVL|PWD|OLDPWD|_"
    r"|RECIPE_TEST_PREWARM\w*"
    r"|CLS_FAULT|CLS_COMM|CUDA_VISIBLE_DEVICES|PYTORCH_NVML_BASED_CUDA_CHECK|_MLFLOW_TELEMETRY_SESSION_ID|PYTHONPATH"
    r"|PET_\w+|TORCH_DISABLE_SHARE_RDZV_TCP_STORE|KMP_DUPLICATE_LIB_OK|KMP_INIT_AT_FORK"
    r"|_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR)")
# Modules every launch imports (the recipe's own imports, accelerate's launcher, torchrun) or most import later
# (datasets, evaluate, the tiny models' classes), imported once by the server; their imports change no environment
# variable and nothing the recipe tests for. DeepSpeed and PEFT are not among them: the recipe asks whether they were
# imported ("deepspeed" in sys.modules, recipes/workarounds/accelerate.py), and `import deepspeed` sets a variable.
PRELOAD = ["recipes.cls", "accelerate.commands.accelerate_cli", "accelerate.commands.launch", "torch.distributed.run",
           "datasets", "evaluate", "safetensors.torch", "transformers.models.roberta.modeling_roberta",
           "transformers.models.llama.modeling_llama"]
# What the DeepSpeed server imports beyond PRELOAD (deepspeed itself first, through the recipe's own
# import_deepspeed_without_mlflow): what a ZeRO rank of deepspeed 0.19.8 imports in `deepspeed.initialize` (the Muon
# optimizer's module, which imports torch._inductor.compile_fx and torch._dynamo; 1.6 CPU-s alone), what an offload
# config's CPU Adam loads its extension with, and what `accelerate launch` imports for a DeepSpeed config.
DEEPSPEED_PRELOAD = ["deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.cpp_extension",
                     "deepspeed.launcher.runner"]
# The launchers the DeepSpeed server forks, whatever their strategy (see the module docstring).
LAUNCHERS = {"accelerate", "accelerate-launch"}
# Scripts that start recipe runs as `sys.executable ...`: their forks see the shim as sys.executable, so those runs come
# back here too (the launchers' ranks; scripts/sweep.py's trials, and the launcher it starts beside sys.executable,
# `accelerate`, which write_shim links to the real one).
STARTS_RUNS = {"accelerate", "torchrun", "accelerate-launch", "sweep.py"}
SHIM = '''#!{python} -S
import json, os, signal, socket, sys, time
REAL = {python!r}
def real():
    os.execv(REAL, [REAL] + sys.argv[1:])
def starting(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False
path = os.environ.get("RECIPE_TEST_PREWARM", "")
if not path.startswith("/"):
    real()
server = int(os.environ.get("RECIPE_TEST_PREWARM_SERVER") or 0)
deadline = time.monotonic() + 120
s = socket.socket(socket.AF_UNIX)
while True:
    try:
        s.connect(path)
        break
    except OSError:
        if not server or not starting(server) or time.monotonic() > deadline:
            real()
        time.sleep(0.1)
fds = []
for fd in (0, 1, 2):
    try:
        os.fstat(fd)
        fds.append(fd)
    except OSError:
        pass
req = json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid(),
                  "ppid": os.getppid(), "fds": fds}}).encode()
socket.send_fds(s, [b"r"], fds)
s.sendall(len(req).to_bytes(8, "big") + req)
f = s.makefile("rb")
line = f.readline().split()
if not line or line[0] != b"pid":
    s.close()
    real()
child = int(line[1])
def forward(sig, frame):
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
    signal.signal(sig, forward)
line = f.readline().split()
if not line:
    os.write(2, b"prewarm shim: the server went away before its fork ended\\n")
    os._exit(255)
if line[0] == b"signal":
    sig = int(line[1])
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(int(line[1]))
'''


def write_shim(folder: str) -> str:
    """The shim, executable, in `folder`: a stand-in for this interpreter that asks the server for a fork; beside it
    a link to this environment's `accelerate` (scripts/sweep.py starts `<sys.executable's folder>/accelerate`)."""
    path = os.path.join(folder, "python")
    with open(path, "w") as f:
        f.write(SHIM.format(python=sys.executable))
    os.chmod(path, 0o755)
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    if os.path.exists(accelerate):
        os.symlink(accelerate, os.path.join(folder, "accelerate"))
    return path


def start() -> subprocess.Popen | None:
    """Start this process's server (None when RECIPE_TEST_PREWARM=0): the shim and the socket go to a new folder
    under /tmp (a socket's path has at most 107 bytes), named in RECIPE_TEST_PREWARM (the socket) and
    RECIPE_TEST_PREWARM_PYTHON (the shim) for helpers.run_recipe, the server's pid in RECIPE_TEST_PREWARM_SERVER. While
    the server imports (about 10 s alone) the shim waits for its socket: a launch started then (a test file's first)
    would otherwise import the stack in each of its processes beside the server, on the same 2 cores. It execs the
    real python when no server runs, when the server has exited (Linux's /proc says so), or after 120 s."""
    if os.environ.get("RECIPE_TEST_PREWARM") == "0":
        return None
    folder = tempfile.mkdtemp(prefix="prewarm-", dir="/tmp")
    os.environ["RECIPE_TEST_PREWARM"] = os.path.join(folder, "socket")
    os.environ["RECIPE_TEST_PREWARM_PYTHON"] = write_shim(folder)
    # RECIPE_TEST_PREWARM_LOG: a file to append the server's log to (each request: forked, or exec'd and why)
    with open(os.environ.get("RECIPE_TEST_PREWARM_LOG", os.path.join(folder, "log")), "a") as log:
        server = subprocess.Popen([sys.executable, __file__, os.environ["RECIPE_TEST_PREWARM"],
                                   os.environ["RECIPE_TEST_PREWARM_PYTHON"], log.name], stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=log, start_new_session=True)
    os.environ["RECIPE_TEST_PREWARM_SERVER"] = str(server.pid)
    return server


def stop(server: subprocess.Popen | None) -> None:
    """Stop the server (its forks still running are killed with it) and delete its folder."""
    if server is None:
        return
    folder = os.path.dirname(os.environ.pop("RECIPE_TEST_PREWARM"))
    os.environ.pop("RECIPE_TEST_PREWARM_PYTHON", None)
    os.environ.pop("RECIPE_TEST_PREWARM_SERVER", None)
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    shutil.rmtree(folder, ignore_errors=True)


def interpreter_args(argv: list[str]) -> tuple[dict, list[str]] | None:
    """({"unbuffered", "module", "code"}, the rest) of a python command line, or None for flags a fork cannot honour."""
    opts = {"unbuffered": False, "module": None, "code": None}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        flag = argv[i]
        if flag == "-u":
            opts["unbuffered"] = True
        elif flag in ("-m", "-c") and i + 1 < len(argv):
            opts["module" if flag == "-m" else "code"] = argv[i + 1]
            return opts, argv[i + 2:]
        else:
            return None
        i += 1
    if i >= len(argv):
        return None  # an interactive interpreter: not a launch
    return opts, argv[i:]


def import_time_differences(env: dict, base: dict, set_by_imports: dict | None = None) -> list[str]:
    """Variables outside LAUNCH_VARIABLES in which `env` differs from `base`, a value the imports set (a fork
    passes those on to the processes it starts) counting as no difference."""
    set_by_imports = set_by_imports or {}
    return sorted(k for k in set(env) | set(base) if env.get(k) != base.get(k) and not LAUNCH_VARIABLES.fullmatch(k)
                  and not (k in set_by_imports and env.get(k) == set_by_imports[k]))


def asked_by(req: dict) -> str:
    """" [<test id>]": the test whose launch sent the request (pytest sets PYTEST_CURRENT_TEST in each worker, and
    launches inherit it), for the log; two workers may share one (RECIPE_TEST_PREWARM_LOG)."""
    test = req["env"].get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return f" [{test}]" if test else ""


def wants_deepspeed(req: dict) -> bool:
    """Whether the DeepSpeed server forks this request (module docstring): a DeepSpeed rank's, or a launcher's."""
    if req["env"].get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return not any("mlflow" in arg for arg in req["argv"])
    opts, args = interpreter_args(req["argv"])
    return opts["module"] is None and opts["code"] is None and os.path.basename(args[0]) in LAUNCHERS


class Server:
    """The first server listens on the shims' socket (`listener`); the DeepSpeed server, its fork, takes the requests
    the first hands it over a socket pair (`handoffs`) and tells it, on the same pair, which shim each of its forks
    stands for, so that either knows the logical parent of a process the other's fork started."""

    def __init__(self, shim: str, log: str | None, base_env: dict, set_by_imports: dict, listener=None,
                 handoffs=None, deepspeed=None):
        self.base_env = base_env
        self.set_by_imports = set_by_imports
        self.shim = shim
        self.log = open(log, "a", buffering=1) if log else None
        self.listener = listener
        self.handoffs = handoffs
        self.deepspeed = deepspeed  # the first server's: (pid, pair end) of the DeepSpeed server while it runs
        self.told = b""     # what the DeepSpeed server has told, up to an unfinished line
        self.conns = {}     # fork pid -> connection to its shim
        self.shims = {}     # fork pid -> the shim's pid (the fork's stand-in in the process tree)
        self.parent = os.getppid()
        self.stopping = False
        self.name = "" if handoffs is None else "deepspeed "

    def stop(self) -> None:
        self.stopping = True

    def note(self, line: str) -> None:
        if self.log:
            self.log.write(self.name + line + "\n")

    def serve(self) -> None:
        while os.getppid() == self.parent and not self.stopping:
            sources = [self.listener or self.handoffs] + ([self.deepspeed[1]] if self.deepspeed else [])
            ready, _, _ = select.select([*sources, *self.conns.values()], [], [], 0.2)
            for conn in ready:
                if conn is self.listener:
                    self.accept()
                elif conn is self.handoffs:
                    self.take_handoff()
                elif self.deepspeed and conn is self.deepspeed[1]:
                    self.hear_deepspeed()
                else:
                    self.shim_gone(conn)
            self.reap()
        for pid in list(self.conns):
            processes.kill_tree(pid)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(30)
        try:
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            size = int.from_bytes(self.recv_exact(conn, 8), "big")
            req = json.loads(self.recv_exact(conn, size))
        except (OSError, ValueError) as e:
            self.note(f"bad request: {e!r}")
            conn.close()
            return
        why = self.refusal(req)
        command = " ".join(req["argv"][:2]).splitlines()[0][:100]
        if why:
            self.note(f"exec {command}{asked_by(req)}: {why}")
            for fd in fds:
                os.close(fd)
            conn.sendall(b"exec\n")
            conn.close()
            return
        req["ppid"] = self.logical_parent(req["ppid"])
        if self.deepspeed and wants_deepspeed(req) and self.hand_over(conn, fds, req):
            return
        self.note(f"fork {command}{asked_by(req)}")
        self.fork(conn, fds, req)

    def hand_over(self, conn, fds: list[int], req: dict) -> bool:
        """Pass the request, the shim's connection and its streams to the DeepSpeed server; False if it is gone."""
        data = json.dumps(req).encode()
        try:
            socket.send_fds(self.deepspeed[1], [b"h"], [conn.fileno(), *fds])
            self.deepspeed[1].sendall(len(data).to_bytes(8, "big") + data)
        except OSError as e:
            self.note(f"the DeepSpeed server is gone ({e!r}): forking here")
            self.deepspeed = None
            return False
        conn.close()
        for fd in fds:
            os.close(fd)
        return True

    def take_handoff(self) -> None:
        """In the DeepSpeed server: a request the first server handed over (nothing: the first server has gone)."""
        msg, fds, _, _ = socket.recv_fds(self.handoffs, 1, 4)
        if not msg:
            self.stopping = True
            return
        conn = socket.socket(fileno=fds[0])
        req = json.loads(self.recv_exact(self.handoffs, int.from_bytes(self.recv_exact(self.handoffs, 8), "big")))
        self.note("fork " + " ".join(req["argv"][:2]).splitlines()[0][:100] + asked_by(req))
        req["ppid"] = self.logical_parent(req["ppid"])
        pid = self.fork(conn, fds[1:], req)
        self.handoffs.sendall(f"{pid} {req['pid']}\n".encode())

    def hear_deepspeed(self, wait_for: int | None = None) -> None:
        """In the first server: read what the DeepSpeed server told (fork pid, shim pid lines), until it has told
        about `wait_for` when given (it tells right after the fork, so this waits for a line already on its way)."""
        pair = self.deepspeed[1]
        pair.settimeout(10 if wait_for else 0)
        try:
            while True:
                chunk = pair.recv(4096)
                if not chunk:
                    self.deepspeed = None
                    break
                self.told += chunk
                *whole, self.told = self.told.split(b"\n")
                for line in whole:
                    fork, shim = map(int, line.split())
                    self.shims[fork] = shim
                if wait_for is None or wait_for in self.shims:
                    break
        except (BlockingIOError, TimeoutError):
            pass
        finally:
            if self.deepspeed:
                pair.settimeout(None)

    def fork(self, conn, fds: list[int], req: dict) -> int:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            self.become(req, fds, conn)  # never returns: the fork exits through SystemExit
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        conn.sendall(f"pid {pid}\n".encode())
        self.conns[pid] = conn
        self.shims[pid] = req["pid"]
        return pid

    @staticmethod
    def recv_exact(conn, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = conn.recv(size - len(data))
            if not chunk:
                raise OSError("short request")
            data += chunk
        return data

    def refusal(self, req: dict) -> str | None:
        if len(req["fds"]) != 3:
            return "stdin, stdout or stderr closed"
        if interpreter_args(req["argv"]) is None:
            return "interpreter flags"
        diff = import_time_differences(req["env"], self.base_env, self.set_by_imports)
        if diff:
            return "environment differs in " + ", ".join(diff)
        if "OMP_NUM_THREADS" in self.base_env and "OMP_NUM_THREADS" not in req["env"]:
            return "OMP_NUM_THREADS unset"
        return None

    def shim_gone(self, conn) -> None:
        """A shim's connection became readable: it sends nothing after its request, so the shim died."""
        for pid, c in list(self.conns.items()):
            if c is conn:
                self.note(f"shim of {pid} gone: killing its tree")
                processes.kill_tree(pid)
                del self.conns[pid]
                conn.close()

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.conns.pop(pid, None)
            self.shims.pop(pid, None)
            if conn is None:
                continue
            if os.WIFSIGNALED(status):
                msg = f"signal {os.WTERMSIG(status)}\n"
            else:
                msg = f"exit {os.waitstatus_to_exitcode(status)}\n"
            try:
                conn.sendall(msg.encode())
            except OSError:
                pass
            conn.close()

    def logical_parent(self, shim_parent: int) -> int:
        """The parent a fresh interpreter would have: the shim's parent, or, when that parent is itself a fork (of
        this server or of the DeepSpeed server), the fork's shim (whose command line, in /proc, is the launch's)."""
        if self.deepspeed and shim_parent not in self.shims and parent_of(shim_parent) == self.deepspeed[0]:
            self.hear_deepspeed(wait_for=shim_parent)
        return self.shims.get(shim_parent, shim_parent)

    def become(self, req: dict, fds: list[int], conn) -> None:
        """In the fork: take over the shim's streams, folder, environment and command line; run it; exit."""
        import builtins
        import io
        import types

        ppid = req["ppid"]
        for own in (self.listener, self.handoffs, self.deepspeed and self.deepspeed[1], *self.conns.values()):
            if own:
                own.close()
        conn.close()
        if self.log:
            self.log.close()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ.update(self.set_by_imports)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        opts, args = interpreter_args(req["argv"])
        unbuffered = opts["unbuffered"] or bool(req["env"].get("PYTHONUNBUFFERED"))
        server_streams = {id(sys.stdout): 1, id(sys.stderr): 2}
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            io.open(1, "wb", buffering=0 if unbuffered else -1, closefd=False), encoding="utf-8",
            line_buffering=os.isatty(1), write_through=unbuffered)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.open(2, "wb", buffering=0 if unbuffered else -1, closefd=False), encoding="utf-8",
            errors="backslashreplace", line_buffering=True, write_through=unbuffered)
        # A logging handler made at import holds the server's stream (deepspeed's logger: its stdout, buffered for the
        # server's log file): it gets the fork's, as it would have in a fresh interpreter.
        for handler in stream_handlers():
            if id(handler.stream) in server_streams:
                handler.stream = sys.stdout if server_streams[id(handler.stream)] == 1 else sys.stderr
        if "OMP_NUM_THREADS" in req["env"]:
            import torch

            torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
        os.getppid = lambda: ppid
        known = set(self.base_env.get("PYTHONPATH", "").split(os.pathsep))
        added = [os.path.abspath(p) for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in known]
        if opts["module"] is not None:
            sys.argv, first = ["-m", *args], os.getcwd()
        elif opts["code"] is not None:
            sys.argv, first = ["-c", *args], ""
        else:
            sys.argv, first = list(args), os.path.dirname(os.path.abspath(args[0]))
        sys.path[0:1] = [first, *added]  # sys.path[0] as the interpreter sets it for -m, -c or a script
        if opts["module"] is not None:
            import runpy

            runpy._run_module_as_main(opts["module"], alter_argv=True)
            sys.exit(0)
        main = types.ModuleType("__main__")
        if opts["code"] is not None:
            source, filename = opts["code"], "<string>"
        else:
            script = args[0]
            filename = os.path.abspath(script)
            main.__file__ = filename
            with open(script, "rb") as f:
                source = f.read()
            if os.path.basename(script) in STARTS_RUNS:
                sys.executable = self.shim  # the ranks it starts come back here
        main.__builtins__ = builtins
        main.__spec__ = None
        sys.modules["__main__"] = main
        exec(compile(source, filename, "exec"), main.__dict__)
        sys.exit(0)


def stream_handlers() -> list:
    """Every logging.StreamHandler of the loggers made so far."""
    import logging

    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers if isinstance(h, logging.StreamHandler)]


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid` from /proc (state "Z": a zombie); None when it is gone. The shim reads the state
    itself: it runs with `python -S` and imports nothing of the tests."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def parent_of(pid: int) -> int | None:
    stat = proc_stat(pid)
    return stat[1] if stat else None


def ready_to_fork(what: str) -> None:
    """Check that a fork of this process after `what` is safe and exact, then gc.freeze() what the imports made.

    Only Python threads are checked: the native ones the imports start (OpenBLAS's pool under numpy and scipy,
    pyarrow's jemalloc thread) stop and restart around fork() by their own atfork handlers, as for DataLoader's fork
    workers. The freeze keeps a fork's garbage collections off the imports' objects: a full collection (the probe's
    rank_memory runs one, and the interpreter its own during a run) otherwise walks and writes the gc header of each
    of about 450,000 objects, copying every page the fork shares with the server: measured 0.5-0.7 CPU-s per fork
    for rank_memory's collection and tensor scan, 0.001 s frozen (33,228 page faults against 996). gc.get_objects()
    does not list frozen objects, so none of them may be a tensor (memstats.live_storages finds the tensors a rank
    holds that way): none are after the imports."""
    import gc
    import threading

    from recipes.model import memstats

    if threading.active_count() != 1:
        sys.exit(f"prewarm: {threading.active_count()} Python threads after {what}: a fork would copy their locks")
    if memstats.live_storages():
        sys.exit(f"prewarm: tensors alive after {what}: frozen, a fork's live_storages would not see them")
    gc.freeze()


def start_deepspeed_server(shim: str, log: str | None, before: dict, set_by_imports: dict):
    """Fork the DeepSpeed server (module docstring); (its pid, the first server's end of their pair), or None where
    deepspeed is not installed."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return None
    mine, theirs = socket.socketpair()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        theirs.close()
        return pid, mine
    mine.close()
    try:  # this fork never returns into the first server's code (the first forks in its stead once it is gone)
        seen = dict(os.environ)
        from recipes.workarounds.deepspeed import import_deepspeed_without_mlflow

        import_deepspeed_without_mlflow(logs_to_mlflow=False)
        for name in DEEPSPEED_PRELOAD:
            __import__(name)
        ready_to_fork("deepspeed's imports")
    except BaseException as e:
        sys.stderr.write(f"prewarm: no DeepSpeed server: {e!r}\n")
        sys.stderr.flush()
        os._exit(1)
    set_by_imports = {**set_by_imports, **{k: v for k, v in os.environ.items() if seen.get(k) != v}}
    server = Server(shim, log, before, set_by_imports, handoffs=theirs)
    signal.signal(signal.SIGTERM, lambda sig, frame: server.stop())
    server.serve()  # its forks leave through SystemExit, in become(), as the first server's do
    os._exit(0)


def main() -> None:
    path, shim = sys.argv[1], sys.argv[2]
    log = sys.argv[3] if len(sys.argv) > 3 else None
    before = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    # What the imports set (torch 2.13.0's inductor sets TORCHINDUCTOR_CACHE_DIR): a fresh interpreter with the same
    # environment sets the same, so each fork gets it on top of its shim's environment.
    if set(before) - set(os.environ):
        sys.exit(f"prewarm: the imports removed {sorted(set(before) - set(os.environ))}")
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    import torch

    if torch.cuda.is_available():
        sys.exit("prewarm: a GPU is visible; forks of a process that may have started CUDA are not served")
    ready_to_fork("the imports")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".tmp")
    listener.listen(128)
    deepspeed = start_deepspeed_server(shim, log, before, set_by_imports)
    server = Server(shim, log, before, set_by_imports, listener=listener, deepspeed=deepspeed)
    signal.signal(signal.SIGTERM, lambda sig, frame: server.stop())
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    server.serve()


if __name__ == "__main__":
    main()
