"""The GPU paths, rehearsed on CPU: what a source review found would crash, hang, silently weaken or slow a GPU run.

No GPU is visible to the suite (conftest hides them); each test mocks what it needs of torch.cuda, captures the
arguments the recipe hands the libraries, counts host syncs, or stubs srun. Each would fail without its fix.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import ACCELERATE, PYTHON, REPO, TINY_FLAGS, free_port, read_jsonl, rank_records, run_recipe
from recipes import RecipeError, checkpoint, data, launch_checks, records, strategy
from recipes.cls import Config, parse_config
from scripts import bench, check_config


def test_output_dir_not_shared_stops_both_machines_at_start_up(tiny_model, tmp_path):
    """Two "machines" on loopback (multinode.yaml, machine ranks 0 and 1) whose --output_dir are different folders,
    as node-local disks would be: both stop at start-up with the one-line reason, long before the collective
    timeout (600 s here), and nothing is left in either folder."""
    port, procs, start = str(free_port()), [], time.monotonic()
    for rank in (0, 1):
        out = tmp_path / f"machine{rank}" / "run"
        cmd = [ACCELERATE, "launch", "--config_file", "accelerate_configs/multinode.yaml", "--machine_rank",
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
                os.killpg(p.pid, signal.SIGKILL)  # the launcher and the rank it started
                p.wait()
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
    nodes x GPUs processes, the first node as the address, and --cpus-per-task handed on to srun."""
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
        "python": f'exec {PYTHON} "$@"',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "gpu-node-[17-18]", "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_CPUS_PER_TASK": "16", "SLURM_SUBMIT_DIR": str(submit)}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm_multinode.sh")], cwd=submit, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("srun --kill-on-bad-exit=1 --cpus-per-task=16 bash -c")
    launches = [line.split() for line in lines if line.startswith("accelerate launch")]
    assert len(launches) == 2
    for rank, args in enumerate(launches):
        flags = dict(zip(args, args[1:]))
        assert flags["--machine_rank"] == str(rank) and flags["--num_processes"] == "8"
        assert flags["--num_machines"] == "2" and flags["--main_process_ip"] == "gpu-node-17"
        assert flags["--main_process_port"] == str(20000 + 4242 % 10000)


def test_stale_extension_lock_is_reported_not_waited_on(tmp_path):
    """A lock left by a killed DeepSpeed op build: one line naming the file. A fresh lock, or one a live builder
    holds open, is left alone."""
    lock = tmp_path / "shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    strategy.check_extension_locks(str(tmp_path))  # fresh: a build may be running
    old = time.time() - 10 * strategy.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    with open(lock):  # held open, as torch's FileBaton holds it while building
        strategy.check_extension_locks(str(tmp_path))
    with pytest.raises(RecipeError, match=f"delete it \\(rm {lock}\\)"):
        strategy.check_extension_locks(str(tmp_path))
    nested = tmp_path / "py311_cpu" / "cpu_adam" / "lock"  # the default root has a python/accelerator level
    nested.parent.mkdir(parents=True)
    nested.touch()
    os.utime(nested, (old, old))
    lock.unlink()
    with pytest.raises(RecipeError, match="cpu_adam/lock"):
        strategy.check_extension_locks(str(tmp_path))


def test_resume_checks_the_cuda_rng_state_of_the_current_device(monkeypatch, tmp_path):
    """Accelerate restores the CUDA generator inside a try/except that swallows errors; the check catches a miss."""
    saved_cuda = [torch.tensor([1, 2, 3], dtype=torch.uint8), torch.tensor([4, 5, 6], dtype=torch.uint8)]
    torch.save({"torch_manual_seed": torch.get_rng_state(), "torch_cuda_manual_seed": saved_cuda},
               tmp_path / "random_states_0.pkl")
    current = {"state": saved_cuda[1].clone()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: current["state"])
    accelerator = SimpleNamespace(process_index=0, load_state=lambda path: None,
                                  state=SimpleNamespace(deepspeed_plugin=None))
    start = checkpoint.ResumePoint(step=4, path=tmp_path, saved_world=1)
    checkpoint.load_checkpoint(accelerator, None, start, 42)  # restored: passes
    current["state"] = torch.tensor([9, 9, 9], dtype=torch.uint8)
    with pytest.raises(RecipeError, match=r"CUDA RNG state of rank 0 \(cuda:1\) was not restored"):
        checkpoint.load_checkpoint(accelerator, None, start, 42)


def test_data_parallel_runs_in_the_precision_the_variable_asks(tiny_model, tmp_path):
    """`python recipes/cls.py --data_parallel` takes ACCELERATE_MIXED_PRECISION (what the bench sets for that run)
    and records the precision that ran: run_config.json and the dtype the first Linear computed in."""
    run_recipe(tmp_path, "--data_parallel", "--max_train_steps", "2", "--record_ranks", config=None,
               env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert json.loads((tmp_path / "run_config.json").read_text())["mixed_precision"] == "bf16"
    assert rank_records(tmp_path)[0]["dtypes"]["forward_output"] == "torch.bfloat16"


def test_bf16_deepspeed_configs_accumulate_gradients_in_fp32(tmp_path):
    shipped = sorted((REPO / "ds_configs").glob("*.json"))
    bf16 = [p for p in shipped if json.loads(p.read_text()).get("bf16", {}).get("enabled")]
    assert len(bf16) >= 4
    for path in bf16:
        assert json.loads(path.read_text())["data_types"] == {"grad_accum_dtype": "fp32"}, path.name
    ds = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    del ds["data_types"]
    bad = tmp_path / "bf16_accum.json"
    bad.write_text(json.dumps(ds))
    recipe = check_config.recipe_flags({})
    assert [p for p in launch_checks.deepspeed_problems(str(bad), "no", False, recipe, 2) if "in bf16" in p] == []
    problems = launch_checks.deepspeed_problems(str(bad), "no", False, {**recipe, "gradient_accumulation_steps": 4}, 2)
    assert [p for p in problems if "accumulates 4 micro-batches of bf16 gradients in bf16" in p]


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
    loop = {name: n for name, n in counts.items() if name.startswith(("cls.", "records.", "strategy.", "problem."))
            and not name.startswith(("cls.evaluate", "cls.main"))}
    assert loop == {"records.flush": 2}, counts
    assert len(read_jsonl(Path(cfg.output_dir) / "metrics.jsonl")) == 4
    faulty, _ = count_syncs(extra_read=True)
    assert faulty.get("cls.train", 0) == 8 and sum(faulty.values()) - sum(counts.values()) == 8, (faulty, counts)


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
            self.state = SimpleNamespace(deepspeed_plugin=None)

    import accelerate

    monkeypatch.setattr(accelerate, "Accelerator", FakeAccelerator)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before = torch.get_float32_matmul_precision()
    try:
        accelerator = strategy.make_accelerator(Config())
        assert captured["dataloader_config"].non_blocking is True and captured["cpu"] is False
        assert torch.get_float32_matmul_precision() == "high"  # fp32 on a GPU: TF32 tensor cores
        torch.set_float32_matmul_precision("highest")
        strategy.set_matmul_precision(Config(tf32=False), accelerator)
        accelerator.mixed_precision = "bf16"
        strategy.set_matmul_precision(Config(), accelerator)
        assert torch.get_float32_matmul_precision() == "highest"  # off when asked, and not needed under bf16
    finally:
        torch.set_float32_matmul_precision(before)


def test_offload_configs_get_deepspeed_cpu_adam_in_adamw_mode():
    """ZeRO-Offload refuses torch's AdamW (zero_force_ds_cpu_optimizer defaults to true in DeepSpeed 0.19.8): the
    offload configs get DeepSpeed's CPU Adam in AdamW mode."""
    offload = json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text())
    assert "zero_force_ds_cpu_optimizer" not in offload
    plugin = SimpleNamespace(deepspeed_config=offload)
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
    groups = [{"params": [torch.nn.Parameter(torch.ones(3))], "weight_decay": 0.01}]
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    optimizer = strategy.make_optimizer(accelerator, groups, 1e-3)
    assert isinstance(optimizer, DeepSpeedCPUAdam) and optimizer.adam_w_mode
    plain = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(
        deepspeed_config=json.loads((REPO / "ds_configs" / "zero2.json").read_text()))))
    assert type(strategy.make_optimizer(plain, groups, 1e-3)) is torch.optim.AdamW


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
    monkeypatch.setattr(strategy, "available_cores", lambda: cores)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(7)  # a value no case expects: "left alone" must keep it
        got = strategy.set_cpu_threads(accelerator, requested)
        assert got == torch.get_num_threads() == (7 if expected is None else expected)
    finally:
        torch.set_num_threads(before)


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
