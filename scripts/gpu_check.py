"""make gpu-check: every shipped config on this machine's CUDA GPUs, against a single-device fp32 reference.

    make gpu-wheels     # on a connected machine: the pinned stack as wheels in .whl/ (scripts/gpu_wheels.py)
    make gpu-check      # on the GPU machine, with the checkout and .whl/: again and again until it says done
    make gpu-check GPU_PYTHON=/opt/torch/.venv/bin/python3 GPU_CHECK_BUDGET=420

What it runs, on a roberta-base-shaped model built offline without dropout, its weights drawn once (seed 42) and
saved, so that every run starts from the same model (--random_init would not: under ZeRO-3's zero3_init_flag,
transformers 5.23 initialises the partitioned parameters on the GPU, whose seeded draws are not the CPU's); or, when
artifacts/minilm has been staged on the machine (`make fetch-pretrained` where the registry is reachable, or the folder
copied there: at 87 MiB it does not travel with a checkout), on that real pretrained encoder, its weight file checked
against the pinned hash and used as it is, with only config.json's dropout set to 0:
- the reduced `BENCH=full` profile of scripts/measure/bench.py (profile_and_spec below): every strategy of
  bench.STRATEGIES (one process per GPU; with one GPU each config runs with --num_processes 1; dataparallel only
  with 2 GPUs or more) and the baselines (loop, trainer, pad128, grouped, padding_free, padding_free_grouped,
  unfused, eager_attn, lora, alternate), in bf16, 30 optimizer steps of 16 samples per device, one round; launched,
  timed and measured by bench's own plan_command / execute / collect. padding_free computes the same samples per step as
  dynamic padding, so its losses are held to the same reference and bound as `single`'s, and bench's ratios give its
  speed-up over `single` beside the bound P/R; padding_free_grouped, like grouped, trains other samples per step: timed
  only;
- the multi-machine configs (accelerate_configs/*multinode*.yaml) as two machines on this host, each with half the
  GPUs (CUDA_VISIBLE_DEVICES), machine 0's address the loopback, as tests/test_strategies.py rehearses them on CPU
  processes: each machine's own `accelerate launch --machine_rank i`, a static rendezvous, NCCL and the bf16 configs,
  as on a cluster, and safe here (a hang is killed at the time limit like any run). What one host cannot show is the
  network between machines (NCCL finds both on one host and takes its shared-memory and P2P paths) and a shared
  filesystem (the output folder is one disk). With one GPU they are listed as skipped, with that reason;
- references: the recipe on one GPU in fp32 with --tf32 false, one per effective batch the runs use (bench gives
  multi-process runs per_device_batch x processes, one-process runs per_device_batch; nn.DataParallel the batch of
  all GPUs), the larger ones as micro-batches of 16 accumulated: the same samples per step, in fp32 the same mean.

- fp16 with the default fused AdamW, on one GPU and under FSDP2 (one process): the recipe with step 3's logits made
  NaN (the probe's fault nan:3:0), a real loss-scale overflow; the run must count the step as skipped, hold the
  learning-rate schedule there and finish (recipes/training/optimizer_step.py OverflowCheck: before it, Accelerate 1.15.0
  reported the fused kernel's skipped step as taken and the non-finite guard stopped the run);

and per config: status, its per-step losses and the reference's, max and mean |difference| and a verdict against
LOSS_BOUND (and the pre-clip gradient norms against GRAD_NORM_BOUND), model-state bytes measured vs
scripts/memory_model.py with the CUDA peaks beside them, samples/s, tokens/s and MFU against the GPU's bf16 peak
(bench.GPU_PEAK_FLOPS), and the bench table of the same runs in bench's format.

`--only single,ddp,...` (GPU_CHECK_ARGS) checks the named configs and baselines only, with their references, and
lists the others as not selected: a machine lent for a few minutes gets a results file of what it could run.

Each command on a GPU machine must end within 8 minutes, so the work is split into parts (the setup, the models,
DeepSpeed's ops, one per run) and one invocation runs parts while its budget (--budget, GPU_CHECK_BUDGET, 420 s)
allows, judged by the longest part so far; each run is also killed at the hard limit (--hard_limit, 450 s from the
start). Finished parts are kept in runs/gpu_check/state.json: the next `make gpu-check` goes on from there, and the
one after the last part writes results/gpu_check_<date>_<gpu slug>.{json,md}.

The setup, run by GPU_PYTHON (the machine's python with its CUDA torch): a venv .venv-gpu with
--system-site-packages and, when GPU_PYTHON is itself a venv, a .pth that adds its site-packages too (a venv made
from a venv sees only the base interpreter's); the pinned packages from .whl/ (`pip install --no-index --find-links
.whl`, .whl/manifest.json lists them); the project with `--no-deps --no-build-isolation -e .`. On a machine where
GPU_PYTHON has no torch or torch sees no CUDA GPU, it says so in one line and exits 0, creating nothing.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-gpu"
WHEELS = REPO / ".whl"
RUNS = REPO / "runs" / "gpu_check"
RESULTS = REPO / "results"
MIB = 1024**2
BUDGET_S = 420  # an invocation starts no part that its budget does not hold (the 8-minute rule, with a margin)
HARD_LIMIT_S = 450  # and kills a run still going this long after its start
MIN_PART_S = 20  # a run given less than this would only be killed
MAX_ATTEMPTS = 2  # a run cut at the hard limit this many times is reported as timed out
# Loss bound, max |bf16 - fp32| over the steps. bf16 keeps 8 significant bits (relative rounding 2^-9, 0.2%): on a
# loss near ln 2 = 0.69 one rounding is 1.4e-3, and 30 steps of forward, backward and update add a few of those
# (expected max |diff| 1e-3 to 1e-2). What this check is for moves the losses by more: a step on other samples, a
# gradient reduced twice or not at all, another learning rate or schedule, another initial model shift the loss by
# the reference's step-to-step change and the gap grows with every step. Measured on an H100 (2026-11-26) at lr 1e-4:
# every bf16 config matched the fp32 reference within 3e-3 for 3 steps, then the trajectory itself went unstable
# (pre-clip gradient norms up to 13 against clipping at 1.0, the reference's loss 0.69 -> 0.98 -> 0.56) and bf16
# rounding was amplified to 0.07 (autocast) - 0.2 (DeepSpeed's bf16 weights) by step 13: chaos, not a strategy fault,
# so the check now trains at RATE, fine-tuning's usual rate, where the reference moves without blowing up.
LOSS_BOUND = 0.02
RATE = 2e-5  # the learning rate of every run of the check (see LOSS_BOUND)
# Pre-clip gradient norms, median over the steps of |run - reference| / reference: bf16 gradients differ by about 1%;
# a wrong loss scale (the mean over ranks taken twice, or not at all) is a factor of the world size, which AdamW and
# clipping hide from the losses.
GRAD_NORM_BOUND = 0.1
MULTINODE = {"multinode": "ddp", "zero2_multinode": "zero2"}  # config: the strategy it launches across machines
PRETRAINED = REPO / "artifacts" / "minilm"  # scripts/fetch_pretrained.py: checked instead of the roberta-base shape
MODEL_NOTES = {"roberta-base": "roberta-base shape, dropout 0, weights drawn once (seed 42)",
               "minilm": "all-MiniLM-L6-v2, pretrained (artifacts/minilm, weight file as pinned), dropout 0"}
CHECK_VERSION = 2  # part of the state fingerprint: a new version of this check starts over
CONFIG_FIELDS = ("name", "config", "kind", "status", "reason", "world", "precision", "effective_batch", "reference",
                 "losses", "reference_losses", "loss_max_abs_diff", "loss_mean_abs_diff", "grad_norm_median_rel_diff",
                 "verdict", "state_measured", "state_predicted", "memory_ratio", "cuda_max_allocated",
                 "cuda_max_reserved", "samples_per_s", "tokens_per_s", "model_flops_per_s", "mfu", "wall_s",
                 "command", "run_dir")


def now() -> float:
    return time.time()  # wall clock: the budget spans the setup process and the checks it hands over to


def say(line: str) -> None:
    print(line, flush=True)


# --- run by GPU_PYTHON: the standard library and torch only -----------------------------------------------------

def preflight() -> str | None:
    """The one line to print when there is nothing to check here; None when torch sees a CUDA GPU."""
    import warnings

    try:
        import torch
    except Exception:
        return f"gpu-check: no CUDA GPU visible ({sys.executable} has no torch): nothing checked, nothing written"
    with warnings.catch_warnings():  # torch warns on stderr when a driver is missing: that would be a second line
        warnings.simplefilter("ignore")
        available = torch.cuda.is_available()
    if not available:
        return f"gpu-check: no CUDA GPU visible (torch {torch.__version__}): nothing checked, nothing written"
    return None


def read_manifest(wheels: Path = WHEELS) -> dict:
    path = wheels / "manifest.json"
    if not path.exists():
        raise SystemExit(f"gpu-check: no {path.relative_to(REPO) if path.is_relative_to(REPO) else path}: run `make "
                         "gpu-wheels` on a connected machine and bring .whl/ along with the checkout")
    return json.loads(path.read_text())


def missing_wheel_line(output: str, wheels: Path = WHEELS) -> str:
    """One line for a failed offline install: the requirement no wheel in .whl/ satisfies, and what to do."""
    match = re.search(r"No matching distribution found for ([^\s]+)", output)
    if not match:
        tail = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return f"gpu-check: installing the pinned stack from {wheels.name}/ failed: {tail[0][:300]}"
    return (f"gpu-check: {wheels.name}/ has no wheel for {match.group(1)}, which this machine needs: run `make "
            f"gpu-wheels` on a connected machine (GPU_WHEELS_SKIP=... to carry a package it skips) and bring "
            f"{wheels.name}/ along")


def site_dirs() -> list[str]:
    """This interpreter's site-packages folders (a venv's and, with include-system-site-packages, the base's)."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return dirs


def setup_key(manifest: dict) -> str:
    """What the installed venv was made from: the wheels, the pins and this interpreter."""
    pins = (REPO / "pyproject.toml").read_bytes()
    return hashlib.sha256(json.dumps([manifest, pins.decode(), sys.executable]).encode()).hexdigest()


def step(command: list, timeout: float, what: str) -> subprocess.CompletedProcess:
    """A setup command, its output kept for the one line that says why it failed."""
    try:
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"gpu-check: {what} did not finish within {timeout:.0f} s; run `make gpu-check` again")


def setup(deadline: float, venv: Path = VENV, wheels: Path = WHEELS) -> bool:
    """.venv-gpu with the pinned stack from the wheels, once; True when it was made now."""
    manifest = read_manifest(wheels)
    stamp = venv / ".gpu-check-installed"
    key = setup_key(manifest)
    if stamp.exists() and stamp.read_text() == key:
        return False
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python_version"] != here:
        raise SystemExit(f"gpu-check: {wheels.name}/ holds wheels for Python {manifest['python_version']}, this is "
                         f"{here}: run `make gpu-wheels GPU_WHEELS_PYTHON={here}` on a connected machine")
    from importlib.metadata import PackageNotFoundError, version

    for name, spec in manifest["skipped_pins"].items():  # not carried: this machine must have them
        try:
            version(name)
        except PackageNotFoundError:
            raise SystemExit(f"gpu-check: {sys.executable} has no {name} and {wheels.name}/ skipped it (pinned "
                             f"{name}{spec}): run `make gpu-wheels GPU_WHEELS_SKIP=...` without it on a connected "
                             "machine and bring .whl/ along")
    say(f"gpu-check: making {venv.name} from {sys.executable} and {len(manifest['files'])} wheels")
    shutil.rmtree(venv, ignore_errors=True)  # a half-made one
    # --without-pip: Debian's and Ubuntu's python3.12 lack ensurepip without their python3.12-venv package; pip
    # comes from .whl/ instead.
    step([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
         deadline - now(), "making the venv")
    python = str(venv / "bin" / "python")
    proc = step([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], 60, "reading the venv")
    if proc.returncode != 0 or not proc.stdout.strip():
        raise SystemExit(f"gpu-check: {python} does not start: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    site_packages = proc.stdout.strip()
    # A venv made from a venv (CPython 3.12 `venv --system-site-packages`) sees only the base interpreter's packages,
    # not GPU_PYTHON's own (its CUDA torch). An `import` line of a .pth file runs at start-up: addsitedir appends
    # them after the venv's site-packages, which therefore wins, and reads their .pth files too.
    Path(site_packages, "_gpu_python_site.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs()))
    pip_wheel = next(wheels.glob("pip-*.whl"), None)
    if pip_wheel is None:
        raise SystemExit(f"gpu-check: {wheels.name}/ has no pip wheel: run `make gpu-wheels` on a connected machine")
    # pip runs from its wheel file (pip/__main__.py supports it) to install itself into the venv, even where
    # GPU_PYTHON's own pip is visible through the .pth: the carried one is the one that was checked.
    install = [python, str(pip_wheel / "pip"), "install", "--no-index", "--find-links", str(wheels), "--quiet",
               "--ignore-installed"]
    proc = step([*install, "pip"], deadline - now(), "installing pip")
    if proc.returncode != 0:
        raise SystemExit(missing_wheel_line(proc.stdout + proc.stderr, wheels))
    pip = [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "--quiet"]
    proc = step([*pip, *manifest["requirements"]], deadline - now(), "installing the pinned stack")
    if proc.returncode != 0:
        raise SystemExit(missing_wheel_line(proc.stdout + proc.stderr, wheels))
    # accelerate may already satisfy its pin from GPU_PYTHON's packages, but bench launches <venv>/bin/accelerate.
    accelerate = [r for r in manifest["requirements"] if r.startswith("accelerate")]
    for command in ([*pip, "--no-deps", "--ignore-installed", *accelerate],
                    [python, "-m", "pip", "install", "--no-index", "--quiet", "--no-deps", "--no-build-isolation",
                     "-e", str(REPO)]):
        proc = step(command, deadline - now(), "installing the project")
        if proc.returncode != 0:
            raise SystemExit(missing_wheel_line(proc.stdout + proc.stderr, wheels))
    stamp.write_text(key)
    return True


def outer(args) -> int:
    """Preflight, setup, then the checks in the venv's python (this process is replaced)."""
    started = now()
    line = preflight()
    if line:
        say(line)
        return 0
    made = setup(started + args.hard_limit)
    python = VENV / "bin" / "python"
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",  # ninja, accelerate
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [str(python), str(Path(__file__).resolve()), "--inner", "--started", str(started), "--budget",
            str(args.budget), "--hard_limit", str(args.hard_limit)] + (["--progressed"] if made else []) + \
        (["--fresh"] if args.fresh else []) + (["--only", args.only] if args.only else [])
    os.execve(str(python), argv, env)
    return 0  # not reached


# --- run in .venv-gpu: the checks -------------------------------------------------------------------------------

def profile_and_spec(model_dir: Path, pretrained: bool = False):
    """The reduced BENCH=full profile (one model: the roberta-base shape, or the staged pretrained encoder; bf16, one
    round) and its model."""
    from scripts.measure import bench

    spec = bench.ModelSpec("minilm" if pretrained else "roberta-base", str(model_dir), False, "bf16", RATE)
    # 10 warm-up steps, bench's own: the probe counts the collectives of steps 3-6 (slowed by its dispatch mode) and
    # the alternate run takes turns in blocks of 5 steps, so the warm-up is a multiple of 5.
    profile = bench.Profile(models=[spec], steps=30, warmup_steps=10, per_device_batch=16, eval_samples=256,
                            repeats=1, alternate_rounds=1, run_timeout=HARD_LIMIT_S)
    return profile, spec


@dataclass
class Part:
    name: str
    kind: str  # models, ops, reference, bench or multinode
    estimate: float  # seconds expected before any run was measured
    skip: str = ""  # why this run cannot run on this machine
    batch: int = 0  # a reference's effective batch


FP16_CONFIGS = ("single", "fsdp")  # the fp16 overflow part's configs (one process each: what one GPU runs)
FP16_FAULT_STEP = 3
NOT_SELECTED = "not selected (--only)"


def plan_parts(n_gpus: int, profile, only: tuple = ()) -> list[Part]:
    """Every part in order: the models, DeepSpeed's ops, a reference per effective batch, the bench runs, the fp16
    overflow runs, the multi-machine configs. With `only`, the runs not named are skipped as not selected (and
    DeepSpeed's ops are built only for a selected offload config)."""
    from scripts.measure import bench

    runs = [name for name, _ in bench.schedule_runs((*bench.STRATEGIES, *bench.BASELINES), 1)]
    skips = {name: bench.skip_reason(bench.Run(model="-", name=name, kind="strategy"), n_gpus) for name in runs}
    if only:
        skips.update({name: NOT_SELECTED for name in runs if name not in only})
    batches = {bench.effective_batch(name, n_gpus, profile) for name in runs if not skips[name]}
    world = machines_world(n_gpus, profile)
    skips.update({name: "" if world else f"runs as two machines on this host with 2 GPUs or more ({n_gpus} visible); "
                  "across real machines it needs a cluster" for name in MULTINODE})
    fp16 = [f"fp16_{name}" for name in FP16_CONFIGS]
    if only:
        skips.update({name: NOT_SELECTED for name in (*MULTINODE, *fp16) if name not in only})
    if world and any(skips[name] != NOT_SELECTED for name in MULTINODE):
        batches.add(profile.per_device_batch * world)
    ops = "" if not only or any(name in only for name in runs if "offload" in name) else NOT_SELECTED
    parts = [Part("models", "models", 120), Part("deepspeed-ops", "ops", 240, ops)]
    parts += [Part(f"reference_b{b}", "reference", 120, batch=b) for b in sorted(batches)]
    parts += [Part(name, "bench", 120, skips[name]) for name in runs]
    parts += [Part(name, "fp16", 90, skips.get(name, "")) for name in fp16]
    return parts + [Part(name, "multinode", 150, skips[name]) for name in MULTINODE]


def machines_world(n_gpus: int, profile) -> int:
    """Processes of a multi-machine config run as two machines here: half the GPUs each (0: fewer than 2 GPUs)."""
    return 2 * (min(n_gpus, profile.max_world) // 2)


def run_step(command: list, timeout: float, env=None) -> subprocess.CompletedProcess:
    """A preparation command in its own process group, killed whole at the timeout; output kept."""
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            from scripts.measure import processes

            processes.kill_launch(proc)
            proc.communicate()
            return subprocess.CompletedProcess(command, -9, f"killed after {timeout:.0f} s")
    return subprocess.CompletedProcess(command, proc.returncode, out)


def write_initial_model(shape_dir: Path, model_dir: Path, seed: int = 42) -> None:
    """The roberta-base shape without dropout (so that bf16-vs-fp32 differences are precision only), tokenizer
    files copied, and a sequence classifier's weights drawn once on the CPU and saved (fp32)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if (model_dir / "model.safetensors").exists():
        return
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in shape_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, tmp / f.name)
    config = AutoConfig.from_pretrained(shape_dir, num_labels=2, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp)
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)


def staged_pretrained() -> bool:
    """Whether the pretrained encoder has been staged here; SystemExit with one line when its weight file is not the
    pinned one (a run on other weights would be reported as this model's)."""
    if not (PRETRAINED / "config.json").is_file():
        return False
    from recipes import RecipeError
    from scripts.fetch_pretrained import check_weights

    try:
        check_weights(PRETRAINED)
    except RecipeError as err:
        raise SystemExit(f"gpu-check: {err}") from None
    return True


def stage_without_dropout(folder: Path, model_dir: Path) -> None:
    """The staged pretrained folder, its files copied as they are (the weight file never saved again) and config.json's
    dropout set to 0, so that bf16-vs-fp32 differences are precision only."""
    if (model_dir / "model.safetensors").exists():
        return
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)


def prepare_models(model_dir: Path, timeout: float, pretrained: bool = False) -> str:
    where = model_dir.relative_to(REPO) if model_dir.is_relative_to(REPO) else model_dir
    if pretrained:
        stage_without_dropout(PRETRAINED, model_dir)
        return f"{where}: all-MiniLM-L6-v2 from {PRETRAINED}, dropout 0"
    shape_dir = REPO / "artifacts" / "roberta-base-shape"
    if not (shape_dir / "config.json").exists():
        proc = run_step([sys.executable, "scripts/build_offline_model.py", "--output_dir", "artifacts/tiny-roberta"],
                        timeout)
        if proc.returncode != 0:
            raise SystemExit(f"gpu-check: scripts/build_offline_model.py failed: {proc.stdout.strip()[-300:]}")
    write_initial_model(shape_dir, model_dir)
    return f"{where}: weights drawn (seed 42)"


def build_ops(timeout: float, retry: bool) -> str:
    """DeepSpeed's CPU Adam, JIT-built now (scripts/build_deepspeed_ops.py) rather than inside the offload runs."""
    if retry:  # this part was killed at the hard limit: its lock would make every later build wait forever
        from torch.utils.cpp_extension import get_default_build_root

        from recipes.workarounds.torch import held_open

        base = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        for lock in [*base.glob("*/lock"), *base.glob("*/*/lock")]:
            if not held_open(lock):
                lock.unlink(missing_ok=True)
    proc = run_step([sys.executable, "scripts/build_deepspeed_ops.py"], timeout)
    return f"rc {proc.returncode}: " + " / ".join(proc.stdout.strip().splitlines()[-2:])[:300]


def limited(profile, deadline: float):
    """The profile with a run timeout that ends by the invocation's hard limit."""
    return replace(profile, run_timeout=int(min(profile.run_timeout, max(1.0, deadline - now()))))


def fresh_run_dir(run, run_dir: Path) -> Path:
    """An empty run folder, as run_bench makes it: no records of an earlier run may be read as this one's."""
    run.run_dir = str(run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    return run_dir


def execute_bench_run(name: str, spec, profile, n_gpus: int, runs_dir: Path, shape, deadline: float):
    """One run of bench's schedule, as run_bench runs it (bench.run_one), ended by the invocation's hard limit."""
    from scripts.measure import bench

    return bench.run_one(spec, name, 0, limited(profile, deadline), runs_dir, "recipes/cls.py", n_gpus, shape, {})


def execute_reference(batch: int, spec, profile, n_gpus: int, runs_dir: Path, shape, deadline: float):
    """The recipe on one GPU in fp32 with full-precision matmuls at effective batch `batch`."""
    from scripts.measure import bench

    fp32 = replace(spec, precision="fp32")
    run = bench.Run(model=spec.name, name="single", kind="reference")
    run_dir = fresh_run_dir(run, runs_dir / f"{spec.name}_reference_b{batch}")
    run.threads = bench.threads_of(1)
    command = bench.plan_command(run, fp32, replace(profile, per_device_batch=batch), run_dir, runs_dir,
                                 "recipes/cls.py", n_gpus)
    micro = profile.per_device_batch
    # Later flags win (argparse): micro-batches of the runs' size, accumulated to `batch`, so memory stays a run's.
    command += ["--tf32", "false", "--per_device_train_batch_size", str(micro),
                "--gradient_accumulation_steps", str(max(1, batch // micro))]
    run.effective_batch = batch
    env = {**bench.run_env(run.threads, 1), "CUDA_VISIBLE_DEVICES": bench.first_gpu()}
    bench.execute(run, command, run_dir, limited(profile, deadline), env)
    if run.status == "ok":
        bench.collect(run, run_dir, profile, shape)
    run.name = f"reference_b{batch}"
    return run


FP16_STEPS = 8


def execute_fp16(name: str, spec, profile, n_gpus: int, runs_dir: Path, shape, deadline: float):
    """The recipe under fp16 on one GPU (`fp16_single`: single.yaml; `fp16_fsdp`: fsdp.yaml with one process) with
    the default fused AdamW, step FP16_FAULT_STEP's logits made NaN by the probe: a real loss-scale overflow."""
    from scripts.measure import bench

    config = name.removeprefix("fp16_")
    run = bench.Run(model=spec.name, name=name, kind="fp16", precision="fp16", effective_batch=profile.per_device_batch)
    run_dir = fresh_run_dir(run, runs_dir / f"{spec.name}_{name}")
    command = [bench.ACCELERATE, "launch", "--config_file", f"accelerate_configs/{config}.yaml", "--num_processes", "1",
               "--main_process_port", str(bench.free_port()), "--mixed_precision", "fp16", "recipes/cls.py",
               "--model_name_or_path", spec.path, "--output_dir", str(run_dir), "--max_train_steps", str(FP16_STEPS),
               "--max_train_samples", str(FP16_STEPS * profile.per_device_batch), "--max_eval_samples", "64",
               "--per_device_train_batch_size", str(profile.per_device_batch), "--learning_rate",
               str(spec.learning_rate), "--warmup_steps", "0", "--logging_steps", "1"]
    env = {**bench.run_env(bench.threads_of(1), 1), "CUDA_VISIBLE_DEVICES": bench.first_gpu(),
           "CLS_FAULT": f"nan:{FP16_FAULT_STEP}:0"}
    bench.execute(run, command, run_dir, limited(profile, deadline), env)
    return run


def fp16_verdict(run: dict) -> dict:
    """What an fp16 overflow run shows: the steps it logged, which it counted as skipped, whether the rate held at
    each skipped step, and the verdict: the injected step skipped, every skipped step's rate held, all steps done."""
    out = {"config": f"accelerate_configs/{run['name'].removeprefix('fp16_')}.yaml --num_processes 1 "
                     "--mixed_precision fp16", "status": run["status"], "reason": run["reason"],
           "fault_step": FP16_FAULT_STEP, "steps": None, "skipped_at": None, "lr": None, "loss": None,
           "rate_held": None, "verdict": f"not judged: {run['status']}", "command": " ".join(run.get("command") or [])}
    if run["status"] != "ok":
        return out
    steps = step_records(run["run_dir"])
    records = [steps[s] for s in sorted(steps)]
    skipped_at = [r["step"] for before, r in zip([{"skipped_steps": 0}, *records], records)
                  if r["skipped_steps"] > before["skipped_steps"]]
    held = [steps[s + 1]["lr"] == steps[s]["lr"] for s in skipped_at if s + 1 in steps]
    out.update(steps=sorted(steps), skipped_at=skipped_at, lr=[r["lr"] for r in records],
               loss=[r["loss"] for r in records], rate_held=all(held))
    ok = sorted(steps) == list(range(1, FP16_STEPS + 1)) and FP16_FAULT_STEP in skipped_at and all(held)
    out["verdict"] = "as expected" if ok else "NOT as expected"
    return out


def spawn(command: list, log_path: Path, env: dict):
    """A second machine's launch, in the background, in its own process group."""
    with open(log_path, "w") as log:
        return subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def execute_multinode(name: str, spec, profile, n_gpus: int, runs_dir: Path, shape, deadline: float):
    """A multi-machine config as two machines on this host: machine 1 in the background, machine 0 through
    bench.execute; each sees half the GPUs, and machine 0's address is the loopback."""
    from scripts.measure import bench

    strategy = MULTINODE[name]
    world = machines_world(n_gpus, profile)
    run = bench.Run(model=spec.name, name=strategy, kind="strategy")
    run_dir = fresh_run_dir(run, runs_dir / f"{spec.name}_{name}")
    run.threads = bench.threads_of(world)  # both machines' processes share this host's cores
    # Planned as the strategy on `world` GPUs (its precision flags and bf16 DeepSpeed JSON), then pointed at the
    # multi-machine YAML with a machine rank each.
    command = bench.plan_command(run, spec, profile, run_dir, runs_dir, "recipes/cls.py", world)
    command[command.index("--config_file") + 1] = f"accelerate_configs/{name}.yaml"
    run.effective_batch = bench.effective_batch(strategy, world, profile)
    env = {**bench.run_env(run.threads, world), **run.env}
    visible = env.get("CUDA_VISIBLE_DEVICES") or ",".join(str(i) for i in range(n_gpus))
    gpus = visible.split(",")[:world]
    half = world // 2
    commands = [command[:2] + ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
                + command[2:] for rank in (0, 1)]
    envs = [{**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[rank * half:(rank + 1) * half])} for rank in (0, 1)]
    other = spawn(commands[1], run_dir / "machine1.log", envs[1])
    try:
        bench.execute(run, commands[0], run_dir, limited(profile, deadline), envs[0])
        other.wait(timeout=max(1.0, min(120.0, deadline - now())) if run.status == "ok" else 5)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if other.poll() is None:
            from scripts.measure import processes

            processes.kill_launch(other)
    if run.status == "ok" and other.returncode != 0:
        log = (run_dir / "machine1.log").read_text(errors="replace") if (run_dir / "machine1.log").exists() else ""
        run.status, run.reason = "failed", "machine 1: " + bench.failure_reason(log)
    if run.status == "ok":
        bench.collect(run, run_dir, profile, shape)  # predicted as the strategy it launches (bench.strategy_of)
    run.name = name
    return run


def add_mfu(run, shape, n_gpus: int, profile, peaks: dict) -> None:
    """Model FLOP/s and MFU of a multi-machine run as bench.run_one computes them for its own runs, over the peak of
    every GPU the run computed on; None where the GPU is not in bench.GPU_PEAK_FLOPS."""
    from scripts.measure import bench

    if run.status != "ok" or not run.tokens_per_s:
        return
    if run.precision not in peaks:
        peaks[run.precision] = bench.device_peak_flops(run.precision, n_gpus, run.threads)
    run.model_flops_per_s = bench.model_flops(shape, run.tokens_per_s)
    devices = max(run.world, run.effective_batch // profile.per_device_batch)
    run.mfu = peaks[run.precision] and run.model_flops_per_s / (peaks[run.precision] * devices)


def fingerprint(n_gpus: int, profile) -> dict:
    import torch

    profile_dict = asdict(profile)
    profile_dict["models"] = [{k: v for k, v in m.items() if k != "path"} for m in profile_dict["models"]]
    key = {"check_version": CHECK_VERSION, "torch": torch.__version__,
           "gpus": [torch.cuda.get_device_name(i) for i in range(n_gpus)], "profile": profile_dict}
    return json.loads(json.dumps(key))  # as state.json holds it (tuples become lists), so that the two compare equal


def load_state(path: Path, key: dict, fresh: bool) -> dict:
    if path.exists() and not fresh:
        state = json.loads(path.read_text())
        if state.get("fingerprint") == key:
            return state
        say(f"gpu-check: the GPUs, torch or the check changed since {path.name} was written: starting over")
    shutil.rmtree(path.parent, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return {"fingerprint": key, "parts": {}, "invocations": [], "results": None}


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(path)  # a killed invocation leaves the previous state, never half of one


def estimate(part: Part, state: dict) -> float:
    """Seconds a part is expected to take: the longest run so far (with a margin) once one has run."""
    if part.skip:
        return 0.0
    if part.kind in ("models", "ops"):
        return part.estimate
    walls = [p["wall_s"] for p in state["parts"].values() if p.get("kind") in ("reference", "bench", "multinode")
             and p.get("status") == "done" and p.get("wall_s")]
    return 1.2 * max(walls) if walls else part.estimate


def run_checks(budget: float = BUDGET_S, started: float | None = None, hard_limit: float = HARD_LIMIT_S,
               runs_root: Path = RUNS, results_dir: Path = RESULTS, progressed: bool = False,
               fresh: bool = False, only: tuple = ()) -> int:
    """Run the parts that the budget holds; write the results once every part is done."""
    import torch

    from scripts import memory_model
    from scripts.measure import bench

    started = now() if started is None else started
    deadline = started + hard_limit
    n_gpus = torch.cuda.device_count()
    pretrained = staged_pretrained()
    model_dir = runs_root / ("minilm-nodropout" if pretrained else "roberta-base-nodropout")
    runs_dir = runs_root / "runs"
    profile, spec = profile_and_spec(model_dir, pretrained)
    parts = plan_parts(n_gpus, profile, only)
    state_path = runs_root / "state.json"
    state = load_state(state_path, {**fingerprint(n_gpus, profile), "only": sorted(only)}, fresh)
    if state.get("results"):
        say(f"gpu-check: done already: {', '.join(state['results'].values())} (GPU_CHECK_ARGS=--fresh checks again)")
        return 0
    state["invocations"].append(dt.datetime.fromtimestamp(started).isoformat(timespec="seconds"))
    save_state(state_path, state)
    shape, peaks = None, {}  # peaks: FLOP/s of one GPU per precision, looked up once
    for index, part in enumerate(parts, 1):
        entry = state["parts"].get(part.name, {})
        if entry.get("status") == "done":
            continue
        left = budget - (now() - started)
        if (progressed and estimate(part, state) > left) or (not part.skip and deadline - now() < MIN_PART_S):
            break
        progressed = True
        begin = now()
        entry = {"kind": part.kind, "attempts": entry.get("attempts", 0) + 1, "status": "done", "run": None}
        if part.kind == "models":
            entry["note"] = prepare_models(model_dir, deadline - now(), pretrained)
        elif part.kind == "ops" and part.skip:
            entry["note"] = f"skipped: {part.skip}"
        elif part.kind == "ops":
            entry["note"] = build_ops(deadline - now(), retry=entry["attempts"] > 1)
        else:
            shape = shape or memory_model.shape_from_model(str(model_dir))
            execute = {"reference": execute_reference, "multinode": execute_multinode, "bench": execute_bench_run,
                       "fp16": execute_fp16}
            try:
                run = execute[part.kind](part.batch or part.name, spec, profile, n_gpus, runs_dir, shape, deadline) \
                    if not part.skip else bench.Run(model=spec.name, name=part.name, kind="strategy",
                                                    status="skipped", reason=part.skip, precision=spec.precision)
            except Exception as err:  # records this check cannot read: the run is reported, the others go on
                run = bench.Run(model=spec.name, name=part.name, kind=part.kind, status="failed",
                                reason=f"gpu-check: {type(err).__name__}: {err}"[:300], precision=spec.precision,
                                effective_batch=part.batch)
            if part.kind == "multinode":  # bench.run_one measures its own runs' MFU
                add_mfu(run, shape, n_gpus, profile, peaks)
            cut = run.status == "timeout"  # every run's time limit is this invocation's hard limit (limited())
            if cut and entry["attempts"] < MAX_ATTEMPTS:
                entry["status"] = "interrupted"  # killed by this invocation's hard limit: the next one tries again
            elif cut:
                run.reason = f"did not finish within an invocation's {hard_limit:.0f} s, {MAX_ATTEMPTS} times"
            entry["run"] = asdict(run)
        entry["wall_s"] = now() - begin
        state["parts"][part.name] = entry
        save_state(state_path, state)
        if entry["run"]:
            say(f"gpu-check [{index}/{len(parts)}] " + bench.format_row(bench.Run(**entry["run"]), "CUDA max alloc"))
        else:
            say(f"gpu-check [{index}/{len(parts)}] {part.name}: {entry['note']} ({entry['wall_s']:.0f} s)")
    left = [p.name for p in parts if state["parts"].get(p.name, {}).get("status") != "done"]
    if left:
        say(f"gpu-check: {len(parts) - len(left)} of {len(parts)} parts done, {len(left)} remain ({', '.join(left)}); "
            f"saved in {state_path.relative_to(REPO) if state_path.is_relative_to(REPO) else state_path}: run "
            "`make gpu-check` again to continue")
        return 0
    results = build_results(state, parts, profile, spec, n_gpus, only)
    paths = write_results(results, results_dir)
    state["results"] = {k: str(p.relative_to(REPO) if p.is_relative_to(REPO) else p) for k, p in paths.items()}
    save_state(state_path, state)
    say("\n" + config_table(results) + "\n")
    say(f"gpu-check: done, all {len(parts)} parts: {', '.join(state['results'].values())}")
    return 0


# --- results -------------------------------------------------------------------------------------------------------

def step_records(run_dir: str) -> dict:
    """{step: record} of a run's metrics.jsonl."""
    from recipes.outputs.records import read_jsonl

    path = Path(run_dir) if Path(run_dir).is_absolute() else REPO / run_dir
    return {r["step"]: r for r in read_jsonl(path / "metrics.jsonl")}


def compare(run: dict, reference: dict | None) -> dict:
    """Per-step losses of a run against its reference, the differences and the verdict."""
    out = {"losses": None, "reference_losses": None, "loss_max_abs_diff": None, "loss_mean_abs_diff": None,
           "grad_norm_median_rel_diff": None}
    if run["status"] != "ok":
        return {**out, "verdict": f"not compared: {run['status']}"}
    if run["name"] == "alternate":
        return {**out, "verdict": "not compared: the alternate run reports block times only"}
    mine = step_records(run["run_dir"])
    out["losses"] = [mine[s]["loss"] for s in sorted(mine)]
    if run["name"] in ("grouped", "padding_free_grouped"):
        return {**out, "verdict": "not compared: length-grouped batches hold other samples per step"}
    if run["name"] == "lora":
        return {**out, "verdict": "not compared: LoRA trains adapters on the frozen model, another training"}
    if reference is None or reference["status"] != "ok":
        return {**out, "verdict": "not compared: the reference " + ("is missing" if reference is None
                                                                     else f"{reference['status']}")}
    ref = step_records(reference["run_dir"])
    out["reference_losses"] = [ref[s]["loss"] for s in sorted(ref)]
    if sorted(mine) != sorted(ref):
        return {**out, "verdict": f"not compared: steps {len(mine)} vs the reference's {len(ref)}"}
    diffs = [abs(mine[s]["loss"] - ref[s]["loss"]) for s in sorted(mine)]
    out["loss_max_abs_diff"], out["loss_mean_abs_diff"] = max(diffs), sum(diffs) / len(diffs)
    norms = [abs(mine[s]["grad_norm"] - ref[s]["grad_norm"]) / ref[s]["grad_norm"] for s in sorted(mine)
             if mine[s].get("grad_norm") and ref[s].get("grad_norm")]
    if norms:
        out["grad_norm_median_rel_diff"] = sorted(norms)[len(norms) // 2]
    within = out["loss_max_abs_diff"] <= LOSS_BOUND and (not norms or out["grad_norm_median_rel_diff"]
                                                         <= GRAD_NORM_BOUND)
    out["verdict"] = "within bound" if within else "OUTSIDE bound"
    return out


def config_label(run: dict) -> str:
    name = run["name"]
    if name in MULTINODE:
        return f"accelerate_configs/{name}.yaml, 2 machines on this host"
    if name == "dataparallel":
        return "python recipes/cls.py --data_parallel"
    if name in ("loop", "trainer", "alternate"):
        return f"scripts/measure/bench_baselines.py {name}"
    from scripts.measure import bench

    flags = "".join(f" {flag}" for flag in bench.RECIPE_VARIANTS.get(name, []))
    yaml = "single" if name in bench.RECIPE_VARIANTS else name
    procs = f" --num_processes {run['world']}" if run["status"] == "ok" else ""
    return f"accelerate_configs/{yaml}.yaml{procs}{flags}"


def versions() -> dict:
    """What ran: the interpreter, torch and its CUDA, cuDNN and NCCL, the pinned libraries and where each came from."""
    import platform
    from importlib.metadata import PackageNotFoundError, distribution

    import torch

    from scripts.gpu_wheels import pyproject_requirements, split_requirement

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    try:
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # a torch without NCCL
        out["nccl"] = None
    pins = {}
    for requirement in pyproject_requirements()[0]:
        name, spec = split_requirement(requirement)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            pins[name] = {"pinned": spec, "installed": None, "from": None}
            continue
        where = Path(str(dist.locate_file(""))).resolve()
        pins[name] = {"pinned": spec, "installed": dist.version,
                      "from": ".venv-gpu (.whl)" if where.is_relative_to(Path(sys.prefix).resolve()) else
                      f"the machine ({where})"}
        out[name] = dist.version
    out["pins"] = pins
    return out


def gpu_info(n_gpus: int) -> dict:
    import torch

    info = {"count": n_gpus, "names": [torch.cuda.get_device_name(i) for i in range(n_gpus)], "driver": None}
    try:
        props = torch.cuda.get_device_properties(0)
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["memory_gib"] = round(props.total_memory / 1024**3, 1)
    except Exception:  # a mocked or half-initialised CUDA
        info["compute_capability"] = info["memory_gib"] = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    if info["driver"] is None and Path("/proc/driver/nvidia/version").exists():
        found = re.search(r"Kernel Module\s+([\d.]+)", Path("/proc/driver/nvidia/version").read_text())
        info["driver"] = found.group(1) if found else None
    return info


def build_results(state: dict, parts: list, profile, spec, n_gpus: int, only: tuple = ()) -> dict:
    from scripts.measure import bench
    from scripts.measure.bench_report import ratios

    peaks = {spec.precision: bench.device_peak_flops(spec.precision, n_gpus, 1)}

    runs = {p.name: state["parts"][p.name]["run"] for p in parts if state["parts"][p.name]["run"]}
    references = {r["effective_batch"]: r for name, r in runs.items() if name.startswith("reference_b")}
    for name, r in runs.items():
        if name.startswith("reference_b"):
            r["losses"] = [rec["loss"] for _, rec in sorted(step_records(r["run_dir"]).items())] \
                if r["status"] == "ok" else None
    configs = []
    for p in parts:
        if p.kind not in ("bench", "multinode"):
            continue
        r = runs[p.name]
        reference = references.get(r["effective_batch"]) if r["status"] == "ok" else None
        row = {"config": config_label(r), "reference": reference and reference["name"], **compare(r, reference)}
        row.update({k: r.get(k) for k in CONFIG_FIELDS if k not in row})
        row["command"] = " ".join(r.get("command") or [])
        configs.append({k: row[k] for k in CONFIG_FIELDS})
    bench_runs = [runs[p.name] for p in parts if p.kind == "bench"]
    gpus = gpu_info(n_gpus)
    work = {spec.name: {"model": spec.path, "random_init": False, "precision": spec.precision,
                        "learning_rate": spec.learning_rate, "steps": profile.steps,
                        "warmup_steps": profile.warmup_steps, "per_device_batch": profile.per_device_batch,
                        "effective_batch": {r["name"]: r["effective_batch"] for r in bench_runs},
                        "eval_samples": profile.eval_samples, "repeats": 1, "max_length": 128, "seed": 42}}
    hardware = {**bench.hardware(), "gpu": gpus}
    ran = versions()
    return {
        "date": dt.date.today().isoformat(), "started": state["invocations"][0],
        "finished": dt.datetime.now().isoformat(timespec="seconds"), "invocations": state["invocations"],
        "parts_s": sum(p.get("wall_s", 0) for p in state["parts"].values()),
        "command": "make gpu-check", "hardware": hardware, "versions": ran,
        "work": {**work[spec.name], "model": MODEL_NOTES[spec.name],
                 "references": "the recipe on one GPU in fp32 with --tf32 false, micro-batches of "
                               f"{profile.per_device_batch} accumulated to each effective batch"},
        "loss_bound": {"loss_max_abs_diff": LOSS_BOUND, "grad_norm_median_rel_diff": GRAD_NORM_BOUND,
                       "why": "bf16 keeps 8 significant bits: one rounding of a loss near ln 2 is 1.4e-3 and 30 steps "
                              "add a few; a step on other samples, a wrong gradient reduction, learning rate or "
                              "initial model moves the losses by more (scripts/gpu_check.py LOSS_BOUND)"},
        "references": {f"reference_b{b}": {k: r.get(k) for k in ("status", "reason", "effective_batch", "losses",
                                                                   "wall_s", "command", "run_dir")}
                       for b, r in sorted(references.items())},
        "configs": configs,
        "selected": sorted(only) or "all",
        "fp16_overflow": [fp16_verdict(runs[p.name]) for p in parts if p.kind == "fp16" and not p.skip],
        "bench": {"memory_label": "CUDA max alloc", "work": work, "hardware": hardware, "versions": ran,
                  "peak_flops": peaks, "runs": bench_runs,
                  "ratios": ratios(bench_runs)},
    }


def fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def config_table(results: dict) -> str:
    lines = ["| config | procs | batch | status | max \\|Δloss\\| | mean \\|Δloss\\| | grad-norm Δ | verdict "
             "| model state MiB (measured / predicted, ratio) | CUDA max alloc / reserved MiB | samples/s | tokens/s "
             "| MFU |", "|---|--:|--:|---|--:|--:|--:|---|--:|--:|--:|--:|--:|"]
    for c in results["configs"]:
        status = c["status"] + (f": {c['reason']}" if c["reason"] else "")
        state = "-" if c["state_measured"] is None else \
            f"{c['state_measured'] / MIB:.1f} / {c['state_predicted'] / MIB:.1f}, {c['memory_ratio']:.3f}"
        cuda = "-" if c["cuda_max_allocated"] is None else \
            f"{c['cuda_max_allocated'] / MIB:.0f} / {fmt(c['cuda_max_reserved'], '.0f', MIB)}"
        lines.append(f"| {c['config']} | {c['world']} | {c['effective_batch'] or '-'} | {status} "
                     f"| {fmt(c['loss_max_abs_diff'], '.2e')} | {fmt(c['loss_mean_abs_diff'], '.2e')} "
                     f"| {fmt(c['grad_norm_median_rel_diff'], '.3f')} | {c['verdict']} | {state} | {cuda} "
                     f"| {fmt(c['samples_per_s'], '.1f')} | {fmt(c['tokens_per_s'], '.0f')} "
                     f"| {fmt(c['mfu'] and 100 * c['mfu'], '.1f')}{'%' if c['mfu'] else ''} |")
    return "\n".join(lines)


def render_markdown(results: dict) -> str:
    from scripts.measure.bench_report import markdown_table, ratio_lines

    hw, v, w = results["hardware"], results["versions"], results["work"]
    gpu = hw["gpu"]
    pins = "; ".join(f"{name} {p['installed']} from {p['from']}"
                     + ("" if p["pinned"] == f"=={p['installed']}" else f" (pinned {p['pinned']})")
                     for name, p in v["pins"].items())
    refs = "; ".join(f"{name}: {r['status']}" + (f", loss {r['losses'][0]:.4f} at step 1, {r['losses'][-1]:.4f} "
                                                  f"at step {len(r['losses'])}" if r.get("losses")
                                                  else f" ({r['reason']})")
                     for name, r in results["references"].items())
    lines = [f"# GPU check {results['date']}: {gpu['count']}x {gpu['names'][0] if gpu['names'] else '?'}", "",
             f"`{results['command']}` in {len(results['invocations'])} invocation(s) from {results['started']} to "
             f"{results['finished']}; the parts took {results['parts_s'] / 60:.1f} min.", "",
             f"Hardware: {gpu['count']}x {', '.join(dict.fromkeys(gpu['names']))} (compute capability "
             f"{gpu.get('compute_capability')}, {gpu.get('memory_gib')} GiB), driver {gpu.get('driver')}; "
             f"{hw['cpu']}, {hw['cpu_cores']} cores, {hw.get('memory_gib', '?')} GiB RAM.",
             f"Versions: Python {v['python']}, torch {v['torch']} (CUDA {v['torch_cuda']}, cuDNN {v['cudnn']}, NCCL "
             f"{v['nccl']}); {pins}.", "", "## Work", "",
             f"{w['model']}, {w['precision']}, {w['steps']} optimizer steps of {w['per_device_batch']} samples per "
             f"device, lr {w['learning_rate']}, throughput after {w['warmup_steps']} warm-up steps, eval on "
             f"{w['eval_samples']} samples, seed {w['seed']}. References: {w['references']}: {refs}.", "",
             f"Verdict: max |Δloss| over the steps against the reference of the same effective batch within "
             f"{results['loss_bound']['loss_max_abs_diff']} and the median relative difference of the pre-clip "
             f"gradient norms within {results['loss_bound']['grad_norm_median_rel_diff']}: "
             f"{results['loss_bound']['why']}.", "", "## Configs", "", config_table(results), "",
             "Model state: bytes of the live tensors of the largest rank after training and the final evaluation "
             "(recipes/model/memstats.py) against scripts/memory_model.py; CUDA: torch.cuda.max_memory_allocated / "
             "max_memory_reserved of the largest rank. MFU: 6 x parameters x tokens/s plus attention, over the bf16 "
             "data-sheet peak of the GPUs the run used (scripts/measure/bench.py GPU_PEAK_FLOPS). Per-step losses: "
             "the .json beside this file.", "", *fp16_lines(results), "## Reduced `BENCH=full` table", "",
             markdown_table(results["bench"]), "",
             *ratio_lines(results["bench"]), ""]
    return "\n".join(lines) + "\n"


def fp16_lines(results: dict) -> list[str]:
    """The fp16 overflow section of the markdown: one row per config; none when no fp16 run was selected."""
    rows = results.get("fp16_overflow") or []
    if not rows:
        return []
    lines = ["## fp16 with fused AdamW: a real loss-scale overflow", "",
             f"Step {rows[0]['fault_step']}'s logits made NaN (CLS_FAULT=nan:{rows[0]['fault_step']}:0), "
             f"{FP16_STEPS} steps, linear decay without warm-up: the step must be counted as skipped, the rate held "
             "at each skipped step, and the run must finish.", "",
             "| config | status | steps | skipped at | rate held | verdict |", "|---|---|--:|---|---|---|"]
    for r in rows:
        status = r["status"] + (f": {r['reason']}" if r["reason"] else "")
        lines.append(f"| {r['config']} | {status} | {len(r['steps'] or [])} | {r['skipped_at']} | {r['rate_held']} "
                     f"| {r['verdict']} |")
    if results.get("selected") != "all":
        lines += ["", f"Selected with --only: {', '.join(results['selected'])}; the other configs were not run."]
    return lines + [""]


def write_results(results: dict, results_dir: Path) -> dict:
    from scripts.measure.bench_report import slug, unused_stem

    gpu = results["hardware"]["gpu"]
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = unused_stem(results_dir,
                       f"gpu_check_{results['date']}_{slug(str(gpu['count']) + 'x ' + (gpu['names'] or ['gpu'])[0])}")
    paths = {"json": results_dir / f"{stem}.json", "md": results_dir / f"{stem}.md"}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["md"].write_text(render_markdown(results))
    return paths


def inner(args) -> int:
    import torch

    if not torch.cuda.is_available():  # GPU_PYTHON's torch saw one: the venv does not reach the same torch
        say(f"gpu-check: {sys.executable} imports torch {torch.__version__} from {Path(torch.__file__).parent}, which "
            f"sees no CUDA GPU; delete {VENV.name} and run `make gpu-check` again")
        return 1
    if not torch.cuda.is_bf16_supported():
        say(f"gpu-check: {torch.cuda.get_device_name(0)} has no bf16 (compute capability below 8.0): this check runs "
            "the bf16 configs; nothing checked")
        return 0
    return run_checks(args.budget, args.started, args.hard_limit, progressed=args.progressed, fresh=args.fresh,
                      only=selection(args.only))


def selection(text: str) -> tuple:
    """--only's names (in .venv-gpu: bench needs the pinned stack); SystemExit with one line for an unknown one."""
    from scripts.measure import bench

    known = (*bench.STRATEGIES, *bench.BASELINES, *MULTINODE, *(f"fp16_{name}" for name in FP16_CONFIGS))
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"gpu-check: --only {', '.join(unknown)}: not a config this check runs ({', '.join(known)})")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds of parts one invocation starts")
    parser.add_argument("--hard_limit", type=float, default=HARD_LIMIT_S, help="seconds after which a run is killed")
    parser.add_argument("--fresh", action="store_true", help="forget the finished parts and check again")
    parser.add_argument("--only", default="", help="comma-separated configs and baselines to check "
                        "(e.g. single,ddp,fsdp,zero2,zero3,fp16_single); default: all")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # in .venv-gpu, after the setup
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--progressed", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return inner(args) if args.inner else outer(args)


if __name__ == "__main__":
    sys.exit(main())
