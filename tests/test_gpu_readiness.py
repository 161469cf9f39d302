"""The GPU paths, rehearsed on CPU: what a source review found would crash, hang, silently weaken or slow a GPU run.

No GPU is visible to the suite (conftest hides them); each test mocks what it needs of torch.cuda, captures the
arguments the recipe hands the libraries, counts host syncs, or stubs srun. Each would fail without its fix.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import (PYTHON, REPO, TINY_FLAGS, free_port, kill_group, launcher, rank_records, read_jsonl,
                     run_in_own_group, run_recipe)
from recipes import RecipeError
from recipes.checkpoints import checkpoint
from recipes.checks import launch_checks
from recipes.cls import Config, parse_config
from recipes.inputs import data
from recipes.outputs import records
from recipes.training import accelerator as setup, optimizer_step
from recipes.workarounds import torch as torch_fixes
from scripts import check_config
from scripts.measure import bench


def test_output_dir_not_shared_stops_both_machines_at_start_up(tiny_model, tmp_path):
    """Two "machines" on loopback (multinode.yaml, machine ranks 0 and 1) whose --output_dir are different folders,
    as node-local disks would be: both stop at start-up with the one-line reason, long before the collective
    timeout (600 s here), and nothing is left in either folder."""
    port, procs, start = str(free_port()), [], time.monotonic()
    for rank in (0, 1):
        out = tmp_path / f"machine{rank}" / "run"
        cmd = [*launcher(), "launch", "--config_file", "accelerate_configs/multinode.yaml", "--machine_rank",
               str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port, "recipes/cls.py",
               *TINY_FLAGS, "--ddp_timeout", "600", "--max_train_steps", "2", "--output_dir", str(out)]
        log = open(tmp_path / f"machine{rank}.log", "w")  # files, not pipes: neither launcher can block on output
        procs.append((subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    try:
        codes = [p.wait(timeout=300) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                kill_group(p)  # the launcher and the rank it started
            log.close()
    elapsed = time.monotonic() - start
    logs = [(tmp_path / f"machine{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [1, 1], logs
    assert elapsed < 300  # the collective timeout is 600 s: both stopped at the check, not in a collective
    for log in logs:
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert errors and "is not shared: rank(s) 1 cannot see what rank 0 writes there" in errors[0], log[-3000:]
    assert not (tmp_path / "machine0" / "run").exists() and not (tmp_path / "machine1" / "run").exists()


@pytest.mark.parametrize("gpus,expected", [(0, []), (1, ["2 processes per machine but 1 GPU(s) visible"]), (2, [])])
def test_more_processes_than_gpus_is_caught_by_checker_and_recipe(monkeypatch, gpus, expected):
    """ddp.yaml's 2 processes on a 1-GPU host would share cuda:0 (accelerate: cuda:{local_rank % device_count})."""
    monkeypatch.setattr(launch_checks, "visible_gpus", lambda: gpus)
    monkeypatch.chdir(REPO)
    problems = launch_checks.check_yaml("accelerate_configs/ddp.yaml", check_config.recipe_flags({}))
    gpu = [p for p in problems if "GPU(s) visible" in p]
    assert [p.split(":")[0] for p in gpu] == expected
    if expected:
        assert "--num_processes 1" in gpu[0]
        with pytest.raises(RecipeError, match="launch with --num_processes 1"):
            launch_checks.check_devices({"LOCAL_WORLD_SIZE": "2"})
    else:
        launch_checks.check_devices({"LOCAL_WORLD_SIZE": "2"})
    # use_cpu configs are CPU runs: no GPU count applies
    assert launch_checks.gpu_count_problems(2, 0) == []


def test_suite_hides_gpus_and_multinode_config_ships_no_address():
    import yaml

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and torch.cuda.device_count() == 0
    config = yaml.safe_load((REPO / "accelerate_configs" / "multinode.yaml").read_text())
    assert "main_process_ip" not in config and config["num_machines"] == 2


def test_slurm_script_with_stub_srun_and_scontrol(tiny_model, tmp_path):
    """scripts/slurm_multinode.sh under stub srun/scontrol/accelerate: one launch per node with its machine rank,
    nodes x GPUs processes, the first node as the address, and --cpus-per-task handed on to srun; the config checker
    (run for real) gets the launch's config and its process and machine counts first. ACCELERATE_CONFIG names another
    config for both."""
    bin_dir, calls, submit = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "submit"
    bin_dir.mkdir()
    submit.mkdir()  # the repository without .venv: the script would activate it and find the real accelerate first
    for name in ("scripts", "recipes", "accelerate_configs", "ds_configs", "artifacts"):
        (submit / name).symlink_to(REPO / name)
    stubs = {
        "scontrol": 'printf "gpu-node-17\\ngpu-node-18\\n"',
        "srun": 'echo "srun $*" >> "$CALLS"; while [[ "$1" == --* ]]; do shift; done\n'
                'for n in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$n "$@"; done',
        "accelerate": 'echo "accelerate $*" >> "$CALLS"',
        "python": f'echo "python $*" >> "$CALLS"; exec {PYTHON} "$@"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu-node-[17-18]", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_CPUS_PER_TASK": "16", "SLURM_SUBMIT_DIR": str(submit)}
    env.pop("ACCELERATE_CONFIG", None)
    for config in ("accelerate_configs/multinode.yaml", "accelerate_configs/zero2_multinode.yaml"):
        calls.unlink(missing_ok=True)
        chosen = {} if config.endswith("/multinode.yaml") else {"ACCELERATE_CONFIG": config}
        proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm_multinode.sh")], cwd=submit,
                              env={**env, **chosen}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = calls.read_text().splitlines()
        check = lines[0].split()
        assert check[:3] == ["python", "scripts/check_config.py", config], lines[0]
        assert dict(zip(check, check[1:]))["--num_processes"] == "8" and dict(zip(check, check[1:]))[
            "--num_machines"] == "2", lines[0]
        assert lines[1].startswith("srun --kill-on-bad-exit=1 --cpus-per-task=16 bash -c")
        launches = [line.split() for line in lines if line.startswith("accelerate launch")]
        assert len(launches) == 2
        for rank, args in enumerate(launches):
            flags = dict(zip(args, args[1:]))
            assert flags["--config_file"] == config
            assert flags["--machine_rank"] == str(rank) and flags["--num_processes"] == "8"
            assert flags["--num_machines"] == "2" and flags["--main_process_ip"] == "gpu-node-17"
            assert flags["--main_process_port"] == str(20000 + 4242 % 10000)
    # a misspelt flag stops the job at the pre-check, before any launch
    calls.unlink()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm_multinode.sh"), "--learning_rat", "1e-5"],
                          cwd=submit, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unrecognized arguments: --learning_rat" in proc.stderr
    assert not any(line.startswith("srun") for line in calls.read_text().splitlines())


@pytest.mark.multiproc
def test_processes_end_without_aborting_at_interpreter_exit():
    """A zero3_offload launch finished, wrote final/, and a rank then died with "terminate called without an active
    exception" (exit -6): a gloo worker thread freeing the tensors of the last collective needed the GIL while the
    interpreter was being finalized. The recipe leaves through training/process.py exit_process instead. 8 launches of 2 ranks
    that end right after an all-gather on a group a module keeps, as DeepSpeed's: every exit code 0. With `--plain`
    (a normal exit) 10 of 20 such launches aborted on this machine, so 8 clean exits of a broken exit path happen
    with a chance of about 0.5^8."""
    torchrun = str(Path(PYTHON).parent / "torchrun")
    for attempt in range(8):
        proc = run_in_own_group([*launcher(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()),
                                 "tests/exit_race_worker.py"], timeout=120)
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (attempt, proc.stderr[-3000:])


def test_stale_extension_lock_is_reported_not_waited_on(tmp_path):
    """A lock left by a killed DeepSpeed op build: one line naming the file. A fresh lock, or one a live builder
    holds open, is left alone."""
    lock = tmp_path / "shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    torch_fixes.check_extension_locks(str(tmp_path))  # fresh: a build may be running
    old = time.time() - 10 * torch_fixes.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    with open(lock):  # held open, as torch's FileBaton holds it while building
        torch_fixes.check_extension_locks(str(tmp_path))
    with pytest.raises(RecipeError, match=f"delete it \\(rm {lock}\\)"):
        torch_fixes.check_extension_locks(str(tmp_path))
    nested = tmp_path / "py311_cpu" / "cpu_adam" / "lock"  # the default root has a python/accelerator level
    nested.parent.mkdir(parents=True)
    nested.touch()
    os.utime(nested, (old, old))
    lock.unlink()
    with pytest.raises(RecipeError, match="cpu_adam/lock"):
        torch_fixes.check_extension_locks(str(tmp_path))


class FakeCuda:
    """Per-device CUDA generator states of a machine with `n` GPUs, on which this process computes on `device`."""

    def __init__(self, monkeypatch, n: int, device: int):
        self.n, self.device = n, device
        self.states = {i: torch.tensor([100 + i], dtype=torch.uint8) for i in range(n)}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: self.states[self._index(device)])
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set_rng_state)

    def _index(self, device) -> int:
        index = self.device if device is None or device == "cuda" else torch.device("cuda", device).index
        if index >= self.n:
            raise RuntimeError(f"invalid device ordinal {index}")
        return index

    def set_rng_state(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()

    def set_rng_state_all(self, states):  # torch.cuda.set_rng_state_all: by device number, stops at a missing one
        for i, state in enumerate(states):
            self.set_rng_state(state, i)


def saved_rng(tmp_path, rank: int, cuda_states: list, cuda_devices):
    """A checkpoint folder holding rank `rank`'s random states; the resume point that names it."""
    torch.save({"torch_manual_seed": torch.get_rng_state(), "torch_cuda_manual_seed": cuda_states},
               tmp_path / f"random_states_{rank}.pkl")
    return checkpoint.ResumePoint(step=4, path=tmp_path, world_size=8, cuda_devices=cuda_devices)


@pytest.mark.parametrize("layout", ["2x4 -> 1x8", "1x8 -> 2x4", "same layout, written before cuda_devices"])
def test_resume_restores_the_cuda_rng_of_the_device_the_rank_saved_on(monkeypatch, tmp_path, layout):
    """Accelerate 1.15.0 saves every visible device's CUDA generator in each rank's random_states file and restores
    them by device number in a try/except that swallows errors. Rank 5 of 2 x 4 GPUs saved on cuda:1 and resumes on
    1 x 8 GPUs on cuda:5 (the old check crashed: 4 states, device 5); rank 4 of 1 x 8 saved on cuda:4 and resumes on
    2 x 4 on cuda:0 (Accelerate gives cuda:0 the state of the old cuda:0: another rank's stream). The recipe puts the
    state of the device the rank saved on (trainer_state.json `cuda_devices`) onto its current device."""
    rank, saved_on, now_on, n_saved, n_now = {"2x4 -> 1x8": (5, 1, 5, 4, 8), "1x8 -> 2x4": (4, 4, 0, 8, 4),
                                              "same layout, written before cuda_devices": (3, 3, 3, 4, 4)}[layout]
    devices = None if layout.startswith("same") else [None] * rank + [saved_on] + [None] * (7 - rank)
    saved_states = [torch.tensor([200 + i], dtype=torch.uint8) for i in range(n_saved)]
    start = saved_rng(tmp_path, rank, saved_states, devices)
    cuda = FakeCuda(monkeypatch, n_now, now_on)

    def accelerate_load_state(path):  # what load_accelerator_state does with the CUDA states: by number, errors eaten
        try:
            cuda.set_rng_state_all(saved_states)
        except RuntimeError:
            pass

    accelerator = SimpleNamespace(process_index=rank, num_processes=1, load_state=accelerate_load_state,
                                  state=SimpleNamespace(deepspeed_plugin=None))
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checkpoint.load_checkpoint(accelerator, optimizer, scheduler, start, 42)
    assert torch.equal(cuda.states[now_on], saved_states[saved_on])  # this rank's own stream, on its device now
    start.cuda_devices = [None] * rank + [n_saved] + [None] * (7 - rank)  # a device the saved file has no state of
    with pytest.raises(RecipeError, match=f"rank {rank} saved from cuda:{n_saved}, but random_states_{rank}.pkl "
                                          f"holds CUDA RNG states for {n_saved} device"):
        checkpoint.load_checkpoint(accelerator, optimizer, scheduler, start, 42)


def test_checkpoint_records_the_cuda_device_of_each_rank(monkeypatch, tmp_path):
    """save_checkpoint writes the device each rank computed on into trainer_state.json (gathered over the ranks)."""
    FakeCuda(monkeypatch, 8, 3)
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None,
                                  save_state=lambda path: (Path(path) / "random_states_0.pkl").write_bytes(b""))
    checkpoint.save_checkpoint(accelerator, tmp_path, checkpoint.TrainerState(step=7))
    state = json.loads((tmp_path / "checkpoints" / "step_7" / "trainer_state.json").read_text())
    assert state == {**asdict(checkpoint.TrainerState(step=7)), "cuda_devices": [3]}
    assert checkpoint.TrainerState.read(tmp_path / "checkpoints" / "step_7").cuda_devices == [3]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_7"


def test_data_parallel_replicas_compute_in_the_callers_autocast_dtype(monkeypatch):
    """nn.DataParallel runs each replica in a thread of its own (torch 2.13.0 parallel_apply), entering autocast
    there with the caller's flag only; a new thread's autocast dtype is the device's default, float16 on CUDA, so a
    bf16 run computed its replicas in fp16 without loss scaling. Rehearsed on CPU: `worker` does what torch's does,
    in a thread whose default is set to float16 as CUDA's is; the `with` around the call is Accelerate's autocast
    around DataParallel.forward. Plain DataParallel shows the fault, the recipe's AutocastDataParallel the fix."""
    import importlib
    import threading

    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")  # the module, not the function
    dtypes = []
    linear = torch.nn.Linear(4, 4)
    linear.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))

    def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
        enabled, results = torch.is_autocast_enabled("cpu"), [None] * len(modules)

        def worker(i, module, args, kwargs):
            torch.set_autocast_dtype("cpu", torch.float16)  # a new CUDA thread's default
            with torch.amp.autocast("cpu", enabled=enabled):
                results[i] = module(*args, **kwargs)

        threads = [threading.Thread(target=worker, args=(i, m, a, k))
                   for i, (m, a, k) in enumerate(zip(modules, inputs, kwargs_tup))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    monkeypatch.setattr(data_parallel, "parallel_apply", parallel_apply)
    x = torch.randn(2, 4)
    for wrapper, autocast, expected in ((torch.nn.DataParallel, True, torch.float16),
                                        (torch_fixes.AutocastDataParallel, True, torch.bfloat16),
                                        (torch_fixes.AutocastDataParallel, False, torch.float32)):  # fp32: none added
        model = wrapper(linear)
        model.src_device_obj = torch.device("cpu")  # what DataParallel sets on a GPU machine (cuda:0)
        dtypes.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outputs = model.parallel_apply([linear, linear], [(x,), (x,)], [{}, {}])
        assert dtypes == [expected, expected] and {o.dtype for o in outputs} == {expected}, wrapper


def test_data_parallel_runs_in_the_precision_the_variable_asks(tiny_model, tmp_path):
    """`python recipes/cls.py --data_parallel` takes ACCELERATE_MIXED_PRECISION (what the bench sets for that run)
    and records the precision that ran: run_config.json and the dtype the first Linear computed in."""
    run_recipe(tmp_path, "--data_parallel", "--max_train_steps", "2", "--record_ranks", config=None,
               env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert json.loads((tmp_path / "run_config.json").read_text())["mixed_precision"] == "bf16"
    assert rank_records(tmp_path)[0]["dtypes"]["forward_output"] == "torch.bfloat16"


def test_bf16_deepspeed_configs_accumulate_gradients_in_fp32_where_it_overlaps(tmp_path):
    """ZeRO-2/3 accumulate bf16 gradients in fp32 (grad_accum_dtype) and still overlap their reduction with backward.
    ZeRO-1 does not set it: with it DeepSpeed 0.19.8 runs stage 1 through BF16_Optimizer (one all-reduce after
    backward, overlap_comm and the buckets unused). Accumulating in bf16 is refused, with that trade-off named."""
    shipped = sorted((REPO / "ds_configs").glob("*.json"))
    configs = {p.stem: json.loads(p.read_text()) for p in shipped}
    bf16 = {name: ds for name, ds in configs.items() if ds.get("bf16", {}).get("enabled")}
    assert sorted(bf16) == ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
    for name, ds in bf16.items():
        assert ds.get("data_types") == (None if name == "zero1" else {"grad_accum_dtype": "fp32"}), name
    recipe = check_config.recipe_flags({})
    for name in ("zero1", "zero2"):
        ds = dict(bf16[name])
        ds.pop("data_types", None)
        bad = tmp_path / f"{name}_bf16_accum.json"
        bad.write_text(json.dumps(ds))
        assert [p for p in launch_checks.deepspeed_problems(str(bad), "no", False, recipe, 2) if "in bf16" in p] == []
        problems = [p for p in launch_checks.deepspeed_problems(
            str(bad), "no", False, {**recipe, "gradient_accumulation_steps": 4}, 2) if "in bf16" in p]
        assert len(problems) == 1 and "accumulates 4 micro-batches of bf16 gradients in bf16" in problems[0]
        assert ("BF16_Optimizer" in problems[0]) == (name == "zero1"), problems


def test_deepspeed_json_sizes_and_overflow_checks_are_explicit():
    """ZeRO-3's buckets are numbers, not Accelerate's "auto" (hidden^2: 589,824 elements for roberta-base, ~150
    reduce-scatters per step); the bf16 configs of ZeRO-1/2 turn off DeepSpeed's per-step overflow check (an
    all-reduce and a host read every step, for a condition bf16 has no loss scale to act on), which DeepSpeed reads
    from the JSON as the setting of the optimizer it builds."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for name in ("zero3", "zero3_offload", "zero3_fp16", "zero3_offload_fp16"):
        zero = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())["zero_optimization"]
        assert {k: zero[k] for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                     "stage3_param_persistence_threshold")} == {
            "reduce_bucket_size": 20_000_000, "stage3_prefetch_bucket_size": 20_000_000,
            "stage3_param_persistence_threshold": 10_000}, name
    for name in ("zero1", "zero2", "zero2_offload"):
        ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
        ds.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1, train_batch_size=8,
                  gradient_clipping=1.0)
        assert DeepSpeedConfig(ds).bfloat16_config.check_grad_overflow is False, name


DISPATCH_FILES = tuple(os.path.join("torch", *name.split("/")) for name in (
    "utils/_python_dispatch.py", "_dynamo/eval_frame.py", "_compile.py"))


class SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts host reads of tensor values (`.item()`, `int()`, `float()`: aten._local_scalar_dense; `.tolist()`)
    by the function of recipes/ that made them directly. Library code (the model, torch.optim's CPU step counters,
    the sampler's permutation on the host) is not the recipe's loop and is not counted."""

    def __init__(self):
        super().__init__()
        self.by_function: dict[str, int] = {}

    def note(self, frame) -> None:
        # step out of the dispatch machinery (torch wraps __torch_dispatch__ in dynamo's eval_frame) and this file
        while frame is not None and (frame.f_code.co_filename == __file__
                                     or frame.f_code.co_filename.endswith(DISPATCH_FILES)):
            frame = frame.f_back
        if frame is not None and f"{os.sep}recipes{os.sep}" in frame.f_code.co_filename:
            name = f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"
            self.by_function[name] = self.by_function.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.note(sys._getframe(1))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count_syncs(monkeypatch, tiny_model, tmp_path):
    """Train the recipe in this process under the counter: 8 micro-batches (batch 8, accumulation 2, 4 steps),
    losses read every 2 steps. Returns {function: host reads}."""
    from accelerate.state import AcceleratorState

    from recipes import cls

    def run(extra_read: bool = False):
        counter = SyncCounter()
        monkeypatch.undo()  # the previous run's patches: each run counts into its own counter only
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            counter.note(sys._getframe(1))
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
        if extra_read:  # the hand-made fault: a loss read on the host every micro-batch
            add = records.StepLog.add
            monkeypatch.setattr(records.StepLog, "add", lambda self, loss, mask: (loss.item(), add(self, loss, mask)))
        cfg = parse_config([*TINY_FLAGS, "--max_train_samples", "64", "--per_device_train_batch_size", "8",
                            "--gradient_accumulation_steps", "2", "--max_train_steps", "4", "--logging_steps", "2",
                            "--output_dir", str(tmp_path / f"run{int(extra_read)}")])
        try:
            with counter:
                cls.main(cfg)
        finally:
            AcceleratorState._reset_state(True)
        return counter.by_function, cfg

    return run


def test_training_loop_reads_nothing_from_the_device_between_log_flushes(count_syncs):
    """4 steps of 2 micro-batches, losses read every 2 steps: the loop's only host reads are the two flushes. The
    same count with a loss read added to every micro-batch (the hand-made fault) finds 8 more, in the loop."""
    counts, cfg = count_syncs()
    loop = {name: n for name, n in counts.items()
            if name.startswith(("cls.", "records.", "optimizer_step.", "accelerator.", "problem."))
            and not name.startswith(("cls.evaluate", "cls.scored", "cls.main", "cls.finish"))}
    assert loop == {"records.flush": 2}, counts
    assert len(read_jsonl(Path(cfg.output_dir) / "metrics.jsonl")) == 4
    faulty, _ = count_syncs(extra_read=True)
    assert faulty.get("cls.train_step", 0) == 8 and sum(faulty.values()) - sum(counts.values()) == 8, (faulty, counts)


def test_fused_adamw_overflow_under_a_real_grad_scaler_is_seen_as_skipped():
    """The mechanism, on a real torch.amp.GradScaler("cpu") and torch's real fused AdamW inside Accelerate's
    AcceleratedOptimizer (what `prepare` makes under fp16): an inf gradient leaves the weights unchanged and halves
    the scale, yet Accelerate 1.15.0 says the step was not skipped (the fused kernel skips internally, so the scaler
    always calls `step`); optimizer_step.OverflowCheck says it was. A finite gradient then updates and is not skipped."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    try:
        weight = torch.nn.Parameter(torch.ones(4))
        optimizer = AcceleratedOptimizer(torch.optim.AdamW([weight], lr=0.1, fused=True),
                                         scaler=torch.amp.GradScaler("cpu"))
        check = optimizer_step.OverflowCheck(accelerator, optimizer)
        assert check.scaler is optimizer.scaler
        seen = []
        for factor in (float("inf"), 1.0):
            optimizer.scaler.scale((weight * factor).sum()).backward()
            check.before_step()
            optimizer.step()
            seen.append((check.skipped(), optimizer.step_was_skipped, optimizer.scaler.get_scale(),
                         weight.detach().clone()))
            optimizer.zero_grad()
    finally:
        AcceleratorState._reset_state(True)
    (skipped, accelerate_says, scale, after_inf), (skipped_2, _, scale_2, after_finite) = seen
    assert (skipped, accelerate_says, scale) == (True, False, 65536.0 * 0.5)  # the gap the check closes
    assert torch.equal(after_inf, torch.ones(4))
    assert (skipped_2, scale_2) == (False, 32768.0) and torch.all(after_finite < 1)


def test_fp16_overflow_steps_hold_the_schedule_and_are_counted(monkeypatch, tiny_model, tmp_path):
    """Under fp16 a step whose gradients overflowed is not applied; the learning-rate schedule, which the recipe steps
    itself (step_scheduler_with_optimizer=False), waits with it, and the non-finite guard does not stop the run. The
    step counter and the data position still advance: the step consumed its window. Rehearsed in one process on CPU
    with what a GPU fp16 run has: Accelerate makes no GradScaler on CPU, so the run's Accelerator gets a real
    torch.amp.GradScaler("cpu") (the loss is scaled in backward and the scaler steps the real fused AdamW, default
    --optim), and the probe makes step 2's logits NaN (CLS_FAULT=nan:2:0): a real overflow, nothing mocked of the skip.
    4 steps, no warm-up, linear decay from 1e-3: the rates used are 1e-3, 7.5e-4, 7.5e-4, 5e-4 (without the check
    the run stops at step 2 with "non-finite gradient norm"); metrics.jsonl and the checkpoints count the skipped
    step, and a run resumed from step 2 continues count, rates, losses and the halved scale (scaler.pt)."""
    import shutil

    from accelerate.state import AcceleratorState

    from recipes import cls

    make_accelerator = setup.make_accelerator

    def with_cpu_scaler(cfg):
        accelerator = make_accelerator(cfg)
        accelerator.scaler = torch.amp.GradScaler("cpu")  # as Accelerator.__init__ makes one for fp16 on CUDA
        return accelerator

    monkeypatch.setattr(setup, "make_accelerator", with_cpu_scaler)
    scales = []
    monkeypatch.setattr(optimizer_step.OverflowCheck, "skipped", lambda self, real=optimizer_step.OverflowCheck.skipped: (
        scales.append(self.scaler.get_scale()) or True) and real(self))

    def run(out, *flags):
        try:
            cls.main(parse_config([*TINY_FLAGS, "--max_train_samples", "64", "--max_eval_samples", "16",
                                   "--per_device_train_batch_size", "8", "--max_train_steps", "4",
                                   "--checkpointing_steps", "2", "--output_dir", str(out), *flags]))
        finally:
            AcceleratorState._reset_state(True)
        return read_jsonl(out / "metrics.jsonl")

    monkeypatch.setenv("CLS_FAULT", "nan:2:0")
    ref = run(tmp_path / "ref")
    assert [r["lr"] for r in ref] == pytest.approx([1e-3, 7.5e-4, 7.5e-4, 5e-4], rel=1e-6, abs=0)
    assert [r["skipped_steps"] for r in ref] == [0, 1, 1, 1] and [r["step"] for r in ref] == [1, 2, 3, 4]
    assert scales == [65536.0, 32768.0, 32768.0, 32768.0]  # read after each step: lowered by step 2's overflow only
    assert all(r["loss"] == r["loss"] for i, r in enumerate(ref) if i != 1) and ref[1]["loss"] != ref[1]["loss"]
    for step in (2, 4):
        state = json.loads((tmp_path / "ref" / "checkpoints" / f"step_{step}" / "trainer_state.json").read_text())
        assert (state["step"], state["skipped_steps"], state["samples_in_epoch"]) == (step, 1, 8 * step)
    shutil.copytree(tmp_path / "ref", tmp_path / "resumed")
    monkeypatch.delenv("CLS_FAULT")
    scales.clear()
    resumed = run(tmp_path / "resumed", "--resume_from_checkpoint", str(tmp_path / "resumed" / "checkpoints" / "step_2"))
    keys = ("step", "lr", "skipped_steps", "loss", "samples")
    assert [[r[k] for k in keys] for r in resumed[2:]] == [[r[k] for k in keys] for r in ref[2:]]
    assert scales == [32768.0, 32768.0]


def test_gpu_runs_get_pinned_prefetched_batches_and_non_blocking_copies(monkeypatch, tiny_model):
    from transformers import AutoTokenizer

    cfg = Config(model_name_or_path=str(tiny_model), max_train_samples=32, max_eval_samples=16)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    train_ds, eval_ds, _ = data.prepare_datasets(cfg, tokenizer)
    gpu = data.build_loaders(cfg, train_ds, eval_ds, tokenizer, 1, device_type="cuda")
    cpu = data.build_loaders(cfg, train_ds, eval_ds, tokenizer, 1, device_type="cpu")
    for loader in (gpu.train, gpu.eval):
        assert (loader.pin_memory, loader.num_workers, loader.persistent_workers) == (True, 2, True)
    for loader in (cpu.train, cpu.eval):
        assert (loader.pin_memory, loader.num_workers) == (False, 0)

    captured = {}

    class FakeAccelerator:
        def __init__(self, **kwargs):
            captured.update(kwargs)
            self.device, self.mixed_precision, self.num_processes = torch.device("cuda", 0), "no", 1
            self.gradient_accumulation_steps = kwargs["gradient_accumulation_steps"]
            self.state = SimpleNamespace(deepspeed_plugin=None)

    import accelerate

    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = torch.get_float32_matmul_precision()
    try:
        accelerator = setup.make_accelerator(Config())
        assert captured["dataloader_config"].non_blocking is True and captured["cpu"] is False
        assert torch.get_float32_matmul_precision() == "high"  # fp32 on a GPU: TF32 tensor cores
        torch.set_float32_matmul_precision("highest")
        setup.use_tf32_matmuls("cuda", accelerator.mixed_precision, tf32=False)
        accelerator.mixed_precision = "bf16"
        setup.use_tf32_matmuls("cuda", accelerator.mixed_precision, tf32=True)
        assert torch.get_float32_matmul_precision() == "highest"  # off when asked, and not needed under bf16
    finally:
        torch.set_float32_matmul_precision(before)


def test_offload_configs_get_deepspeed_cpu_adam_in_adamw_mode():
    """With offload_optimizer, Accelerate 1.15.0 replaces the optimizer it is given by DeepSpeed's CPU Adam
    (map_pytorch_optim_to_deepspeed, zero_force_ds_cpu_optimizer unset), in AdamW mode only when it was given a torch
    AdamW. The recipe gives it one, so the decay stays decoupled; DeepSpeed's own CPU Adam in AdamW mode, what the
    recipe built before, came back in L2 mode (weight decay added to the gradient). The launches that check the
    optimizer DeepSpeed really steps are in tests/test_strategies.py."""
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    groups = [{"params": [torch.nn.Parameter(torch.ones(3))], "weight_decay": 0.01},
              {"params": [torch.nn.Parameter(torch.ones(2))], "weight_decay": 0.0}]
    mapped = map_pytorch_optim_to_deepspeed(torch.optim.AdamW(groups, lr=1e-3))
    assert isinstance(mapped, DeepSpeedCPUAdam) and mapped.adam_w_mode
    assert [(g["weight_decay"], g["lr"], g["betas"], g["eps"]) for g in mapped.param_groups] == [
        (0.01, 1e-3, (0.9, 0.999), 1e-8), (0.0, 1e-3, (0.9, 0.999), 1e-8)]
    assert not map_pytorch_optim_to_deepspeed(DeepSpeedCPUAdam(groups, lr=1e-3, adamw_mode=True)).adam_w_mode


@pytest.mark.parametrize("device, ds_json, requested, omp, local, cores, expected", [
    ("cpu", None, 0, "1", "1", 2, 2),  # accelerate launch's OMP_NUM_THREADS=1 default: the machine's cores
    ("cpu", None, 0, "1", "2", 2, 1),  # two processes on two cores: one each
    ("cpu", None, 0, None, "3", 16, 5),  # plain python (no OMP_NUM_THREADS), three local processes
    ("cpu", None, 0, "3", "2", 16, 3),  # the user's OMP_NUM_THREADS (above 1) is kept
    ("cpu", None, 4, "1", "2", 2, 4),  # --cpu_threads wins
    ("cuda", "zero2_offload.json", 0, "1", "2", 16, 8),  # GPU run, optimizer step on CPU: CPU Adam gets the cores
    ("cuda", "zero2.json", 0, "1", "2", 16, None),  # GPU run, optimizer on GPU: left alone
    ("cuda", None, 4, "1", "1", 16, None),
])
def test_cpu_threads_follow_the_machine_unless_the_user_chose(monkeypatch, device, ds_json, requested, omp, local,
                                                              cores, expected):
    """accelerate launch 1.15.0 gives every process OMP_NUM_THREADS=1 unless the config says use_cpu: a CPU run would
    train on one core. set_cpu_threads gives each process cores / local processes, or what the user asked for."""
    config = json.loads((REPO / "ds_configs" / ds_json).read_text()) if ds_json else None
    plugin = config and SimpleNamespace(deepspeed_config=config)
    accelerator = SimpleNamespace(device=torch.device(device), state=SimpleNamespace(deepspeed_plugin=plugin))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    monkeypatch.setattr(setup, "available_cores", lambda: cores)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(7)  # a value no case expects: "left alone" must keep it
        got = setup.set_cpu_threads(accelerator, requested)
        assert got == torch.get_num_threads() == (7 if expected is None else expected)
    finally:
        torch.set_num_threads(before)


def test_more_threads_than_cpus_are_kept_and_said_once_per_machine(monkeypatch, capsys):
    """OMP_NUM_THREADS=2 in each of 2 processes on 2 CPUs made a DDP step 217 ms against 104 ms (2.1x): the user's
    threads are kept, and local rank 0 says what they cost and what gives each CPU one thread."""
    accelerator = SimpleNamespace(device=torch.device("cpu"), state=SimpleNamespace(deepspeed_plugin=None))
    monkeypatch.setattr(setup, "available_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = torch.get_num_threads()
    try:
        for rank, said in (("0", True), ("1", False)):
            monkeypatch.setenv("LOCAL_RANK", rank)
            assert setup.set_cpu_threads(accelerator) == 2
            err = capsys.readouterr().err
            assert err == ("warning: 2 processes x 2 threads on 2 CPUs: the threads take turns, which on CPU can take "
                           "several times as long; --cpu_threads 1 (or unset OMP_NUM_THREADS) gives each CPU one\n"
                           if said else "")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # accelerate's default: cores / processes, one each
        assert setup.set_cpu_threads(accelerator) == 1 and capsys.readouterr().err == ""
    finally:
        torch.set_num_threads(before)
    assert setup.oversubscription(4, 1, 2).startswith("4 threads on 2 CPUs")
    assert setup.oversubscription(3, 1, 1).startswith("3 threads on 1 CPU:")
    assert setup.oversubscription(1, 4, 2) is None  # more processes than CPUs: the launch's choice
    assert setup.oversubscription(2, 4, 8) is None


def test_bench_baselines_take_one_gpu_the_runs_precision_and_the_recipes_matmul_math(monkeypatch, tmp_path):
    """BENCH=full on 4 GPUs: loop, Trainer and `alternate` run in one process on the first visible GPU (Trainer would
    take all four: nn.DataParallel and 4 x the batch) in the model's precision, and the baselines refuse several GPUs
    themselves; on a GPU in fp32 they compute with TF32 matmuls as the recipe does (recipes/training/accelerator.py
    use_tf32_matmuls), so the fp32 comparisons are of the same math."""
    from scripts.measure import bench_baselines

    profile = bench.PROFILES["full"]
    spec = next(s for s in profile.models if s.name == "roberta-base")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5")
    for name in ("loop", "trainer", "alternate", "ddp"):
        run = bench.Run(model=spec.name, name=name, kind="baseline" if name in bench.BASELINES else "strategy")
        command = bench.plan_command(run, spec, profile, tmp_path / name, tmp_path, "recipes/cls.py", 4)
        if name == "ddp":
            assert run.env == {} and run.world == 4
        else:
            assert run.env == {"CUDA_VISIBLE_DEVICES": "2"} and command[command.index("--precision") + 1] == "bf16"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match="the baselines run on one GPU"):
        bench_baselines.select_device("fp32", True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.get_float32_matmul_precision()
    try:
        for precision, tf32, expected in (("bf16", True, "highest"), ("fp32", False, "highest"),
                                          ("fp32", True, "high")):
            torch.set_float32_matmul_precision("highest")
            assert bench_baselines.select_device(precision, tf32).type == "cuda"
            assert torch.get_float32_matmul_precision() == expected, (precision, tf32)
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("n_gpus", range(1, 9))
def test_bench_plans_every_gpu_count(n_gpus):
    """BENCH=full on 1..8 GPUs: a fixed per-device batch, the effective batch scales with the devices; impossible
    runs are skipped with their reason, nothing raises."""
    profile = bench.PROFILES["full"]
    rows = {r["name"]: r for r in bench.plan(profile, n_gpus)}
    assert set(rows) == set(bench.STRATEGIES) | set(bench.BASELINES)
    for name, row in rows.items():
        assert row["per_process_batch"] * row["world"] == row["effective_batch"]
        if name in ("ddp", "fsdp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"):
            assert row["world"] == n_gpus and row["per_process_batch"] == profile.per_device_batch
        elif name == "dataparallel":
            assert row["effective_batch"] == profile.per_device_batch * n_gpus
            assert bool(row["skipped"]) == (n_gpus < 2)
        else:
            assert (row["world"], row["effective_batch"]) == (1, profile.per_device_batch)
        assert name == "dataparallel" or not row["skipped"]
