"""Every workaround between the recipe and Accelerate / DeepSpeed / torch, in one place.

The recipe never names a strategy: the launch config picks it, and this module makes the same recipe run under it,
on GPUs and, for CI, on CPU processes. Each workaround names the library limit and the version it was read in.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch

from recipes import RecipeError
from recipes.checks import launch_checks
from recipes.model import compilation, fsdp_wrap
from recipes.outputs import tracking


def unwrap_without_importing_deepspeed() -> None:
    """Accelerate 1.15.0's `extract_model_from_parallel` (behind `unwrap_model`, `get_state_dict`, `save_model`)
    imports deepspeed whenever it is installed, to test whether the model is a DeepSpeedEngine: 1.1 s on this
    machine's runs without DeepSpeed, 0.9 s of it mlflow, which deepspeed 0.19.8's autotuner imports when it is
    installed (the trackers extra). No engine exists before deepspeed is imported (a DeepSpeed launch imports it in
    `Accelerator(...)` and `prepare`), so the test asks for deepspeed only once it is there: the same answer for every
    model, without the import. The name is looked up in accelerate.utils.other, where only that function uses it."""
    from accelerate.utils import other

    available = other.is_deepspeed_available
    if not getattr(available, "recipe_checks_import", False):
        def imported_and_available() -> bool:
            return "deepspeed" in sys.modules and available()

        imported_and_available.recipe_checks_import = True
        other.is_deepspeed_available = imported_and_available


def import_deepspeed_without_mlflow(cfg) -> None:
    """Import deepspeed with mlflow hidden, unless this run logs to MLflow: deepspeed 0.19.8 imports
    `deepspeed.autotuning.autotuner` at `import deepspeed`, and that module imports mlflow whenever it is installed
    (the trackers extra), about 0.9 s per rank here, for its autotuning experiments only (the `deepspeed --autotuning`
    launcher; a training process never runs them). The autotuner catches the failed import (`has_mlflow = False`);
    afterwards `import mlflow` works again for whoever asks."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules or "mlflow" in tracking.tracker_names(cfg.report_to):
        return
    sys.modules["mlflow"] = None  # `import mlflow` raises ModuleNotFoundError while this entry is None
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]


def make_accelerator(cfg):
    """The Accelerator for a launch config; on a machine without GPUs it rehearses the same strategy on CPU.

    Without an accelerator the processes must talk over gloo, and `cpu=True` is what turns a MULTI_GPU launch into
    MULTI_CPU (accelerate 1.15.0): with `cpu=False` every rank trains alone and nothing fails.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs

    launch_checks.check_devices(os.environ, cfg.data_parallel)
    launch_checks.check_cpu_binding(os.environ)  # a launcher's OpenMP binding would put every rank on one CPU
    on_cpu = not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false") == "true"
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # a backend given to a single process makes it wait
    gloo = on_cpu and launched
    if deepspeed:
        check_extension_locks()
        import_deepspeed_without_mlflow(cfg)
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout), backend="gloo" if gloo else None)
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.ddp_find_unused_parameters)
    accelerator = Accelerator(
        cpu=on_cpu and not deepspeed,  # cpu=True would replace the DeepSpeed launch by plain MULTI_CPU
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the recipe steps the scheduler once per optimizer step itself
        log_with=tracking.prepare_trackers(cfg),  # --report_to
        project_dir=cfg.output_dir,
        kwargs_handlers=[group, ddp],
        dynamo_plugin=compilation.dynamo_plugin(cfg),  # --torch_compile; None: the launch config's dynamo_config
        # Host-to-device copies that do not wait: the batch comes from pinned memory on GPUs (data.build_loaders).
        dataloader_config=DataLoaderConfiguration(non_blocking=not on_cpu),
    )
    check_agreement(accelerator, cfg)  # a launch config's accumulation over --gradient_accumulation_steps
    use_tf32_matmuls(accelerator.device.type, accelerator.mixed_precision, cfg.tf32)
    set_cpu_threads(accelerator, cfg.cpu_threads)
    if on_cpu and fsdp:
        rehearse_fsdp_on_cpu(accelerator)
    reduce_fsdp_gradients_in_fp32(accelerator)
    unwrap_without_importing_deepspeed()
    if cfg.torch_dtype == "float16" and accelerator.mixed_precision == "fp16" and not deepspeed:
        raise RecipeError("--torch_dtype float16 under fp16 mixed precision: torch 2.13.0's GradScaler cannot unscale "
                          "fp16 gradients; keep fp32 master weights (the default) or use bf16")
    if cfg.data_parallel and accelerator.num_processes > 1:
        raise RecipeError("--data_parallel runs in one process: use `python recipes/cls.py`, not a multi-process launch")
    return accelerator


def rehearse_fsdp_on_cpu(accelerator) -> None:
    """Turn the MULTI_CPU state of a CPU-only FSDP launch into the FSDP state a GPU launch gets.

    Accelerate 1.15.0 sets up FSDP only for accelerator device types (MULTI_GPU, MULTI_XPU, ...), so an FSDP launch
    without GPUs silently becomes plain MULTI_CPU data parallelism, while torch's `fully_shard` itself trains on CPU
    with gloo. Here the state is switched to FSDP with the plugin the launcher's FSDP_* environment describes, so
    `accelerator.prepare` takes the very code path of a GPU run. The distributed type must be set in PartialState's
    shared state too: every new AcceleratorState() copies it from there. Only reached when no GPU is visible.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables set by `accelerate launch`
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def reduce_fsdp_gradients_in_fp32(accelerator) -> None:
    """FSDP under bf16/fp16: compute in the low dtype, but reduce and accumulate gradients in fp32.

    Accelerate 1.15.0 (`FullyShardedDataParallelPlugin.set_mixed_precision`) sets reduce_dtype = param_dtype. FSDP2
    (torch 2.13.0, `FSDPParam.to_accumulated_grad_if_needed`) keeps the unsharded gradient across the micro-batches
    of `accelerator.accumulate` (no gradient sync) in that dtype, so accumulation summed bf16 gradients (8 bits of
    mantissa), and the reduce-scatter summed the ranks' gradients in bf16 as well. With reduce_dtype fp32, FSDP2
    upcasts each micro-batch's gradient into an fp32 accumulator and reduce-scatters in fp32: the gradient the
    optimizer sees is what an fp32 sum gives, for twice the bytes of the reduce-scatter (not of the all-gathers).
    The launch config cannot say this (no accelerate launch key for the policy), so it is set here, before prepare.
    """
    import dataclasses

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is None or accelerator.mixed_precision == "no":
        return
    plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)


def complete_plugins(accelerator, cfg, model) -> None:
    """What the launch config leaves to the recipe, set before `accelerator.prepare`: DeepSpeed's "auto" values that
    Accelerate cannot fill, and the classes FSDP shards one at a time when the YAML names none."""
    fill_deepspeed_auto(accelerator, cfg)
    set_fsdp_wrap_classes(accelerator, model)


def set_fsdp_wrap_classes(accelerator, model) -> list[str]:
    """Under FSDP's transformer-based wrap with no class named in the YAML, the classes of recipes/model/fsdp_wrap.py.

    Accelerate 1.15.0 reads `transformer_cls_names_to_wrap` from FSDP_TRANSFORMER_CLS_TO_WRAP (None when the YAML has
    no `fsdp_transformer_layer_cls_to_wrap`) and, when None, takes the model's `_no_split_modules` inside `prepare`
    (`FullyShardedDataParallelPlugin.set_auto_wrap_policy`); set here, it takes these instead. Returns the names.
    """
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    policy = getattr(plugin, "auto_wrap_policy", None)
    if getattr(policy, "func", policy) is not transformer_auto_wrap_policy:
        return []
    if plugin.transformer_cls_names_to_wrap is None:
        names, source = fsdp_wrap.wrap_classes(model)
        plugin.transformer_cls_names_to_wrap = names
        accelerator.print(f"FSDP shards {', '.join(names)} one at a time ({source} of {type(model).__name__})")
    return list(plugin.transformer_cls_names_to_wrap)


def drop_unused_weight_renamings(model):
    """Keep a model loaded under ZeRO-3 from saving some weights under legacy names (LayerNorm.gamma / .beta).

    transformers 5.23 remembers the key renamings a `from_pretrained` applied, so that `save_pretrained` writes the
    names the checkpoint had. Its usual loader keeps only the renamings that matched a key; its DeepSpeed ZeRO-3 loader
    (integrations/deepspeed.py, `model_to_load._weight_conversions = weight_mapping`) keeps them all, the "legacy"
    LayerNorm.gamma -> LayerNorm.weight among them, so final/ of a zero3 run named every LayerNorm.weight
    LayerNorm.gamma: transformers reads it back, other readers of the file do not. Filtered here as the usual loader
    does (`WeightTransform.was_used`). Returns the model.
    """
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions if c.was_used()]
    return model


def fill_deepspeed_auto(accelerator, cfg) -> None:
    """Fill the DeepSpeed "auto" values that Accelerate cannot fill from the recipe's objects, then check the others.

    - train_micro_batch_size_per_gpu: Accelerate 1.15.0 reads it from `DataLoader.batch_size`, which is None for a
      loader built on a batch sampler; its error message asks for exactly this assignment.
    - gradient_clipping: Accelerate 1.15.0 fills "auto" with a constant 1.0; the recipe's --max_grad_norm rules.
    A value that is not "auto" (a YAML's deepspeed_config key, exported by `accelerate launch`) must equal the
    recipe's (after --auto_micro_batch chose the split): the engine would use it instead. Without DeepSpeed there is
    nothing to fill.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    for key, value in (("train_micro_batch_size_per_gpu", cfg.per_device_train_batch_size),
                       ("gradient_clipping", cfg.max_grad_norm)):
        if plugin.is_auto(key):
            plugin.deepspeed_config[key] = value
    check_agreement(accelerator, cfg, {key: plugin.deepspeed_config.get(key) for key in DEEPSPEED_KEYS})


# The recipe's flag behind each value the Accelerator or the DeepSpeed engine may take from elsewhere.
DEEPSPEED_KEYS = {"gradient_accumulation_steps": "gradient_accumulation_steps",
                  "gradient_clipping": "max_grad_norm",
                  "train_micro_batch_size_per_gpu": "per_device_train_batch_size"}


def value_source(key: str) -> str:
    """Where a value other than the recipe's came from: the variable `accelerate launch` exports for a launch
    config's deepspeed_config key (utils/launch.py, 1.15.0), a variable the user set, or the DeepSpeed JSON."""
    variable = f"ACCELERATE_{key.upper()}"
    if variable in os.environ:
        from_yaml = key in os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
        return (f"the launch config's deepspeed_config.{key}, exported by accelerate launch as {variable}"
                if from_yaml else f"the environment variable {variable}")
    return f"the DeepSpeed config ({os.environ.get('ACCELERATE_DEEPSPEED_CONFIG_FILE', 'deepspeed_config')})"


def check_agreement(accelerator, cfg, used: dict | None = None) -> None:
    """Stop when the accumulation, clipping or micro-batch the Accelerator or the DeepSpeed engine will use differs
    from the recipe's: one line naming both values and where the other came from.

    Accelerate 1.15.0's `Accelerator.__init__` prefers ACCELERATE_GRADIENT_ACCUMULATION_STEPS over its argument
    (`parse_choice_from_env`), and `accelerate launch` exports a YAML's `deepspeed_config.gradient_accumulation_steps`
    and `gradient_clipping` under those names, which `accelerate config` always writes for DeepSpeed without a JSON.
    The recipe counts its windows of micro-batches from --gradient_accumulation_steps: a disagreement stepped on the
    wrong micro-batches, ran the schedule at the wrong pace and logged a wrong loss, while run_config.json said
    otherwise. `used`: the values to check (key: value); by default the Accelerator's accumulation. Called when the
    Accelerator is made, before `prepare` (DeepSpeed's config) and after it (the engine's own, check_engine).
    """
    used = used if used is not None else {"gradient_accumulation_steps": accelerator.gradient_accumulation_steps}
    problems = []
    for key, value in used.items():
        flag = DEEPSPEED_KEYS[key]
        asked = getattr(cfg, flag)
        if value is None or value == "auto" or float(value) == float(asked):
            continue
        problems.append(f"{key} {value} from {value_source(key)}, but --{flag} {asked}")
    if problems:
        raise RecipeError("the launch would train with other settings than the recipe's flags: " + "; ".join(problems)
                          + ": remove them from the launch config (or set them to \"auto\"), or pass the same flags")


def check_engine(accelerator, cfg, model) -> None:
    """After `prepare`: what the DeepSpeed engine really uses (accumulation, clipping, micro-batch, precision)
    equals the recipe's and what run_config.json records; the Accelerator's accumulation too, without DeepSpeed."""
    engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
    engine = engine.engine if engine is not None else None
    if engine is None:
        check_agreement(accelerator, cfg)
        return
    check_agreement(accelerator, cfg, {"gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                                       "gradient_clipping": engine.gradient_clipping(),
                                       "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu()})
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "no"
    if precision != accelerator.mixed_precision:
        raise RecipeError(f"the DeepSpeed engine computes in {precision}, but the Accelerator reports "
                          f"{accelerator.mixed_precision}: set the precision in the DeepSpeed JSON only")


def maybe_data_parallel(model, cfg, accelerator):
    """Plain `nn.DataParallel` over the visible GPUs when asked for and more than one is there."""
    if not cfg.data_parallel:
        return model
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        accelerator.print(f"--data_parallel: {n_gpus} GPU(s) visible, falling back to one device ({accelerator.device})")
        return model
    accelerator.print(f"--data_parallel: nn.DataParallel over {n_gpus} GPUs")
    return AutocastDataParallel(model)


class AutocastDataParallel(torch.nn.DataParallel):
    """`nn.DataParallel` whose replicas compute in the autocast dtype of the caller, not in fp16.

    Accelerate wraps the prepared model's forward in autocast (bf16 for `mixed_precision=bf16`), which for a
    DataParallel model is DataParallel.forward in the main thread. torch 2.13.0's parallel_apply then runs each replica
    in a thread of its own under `torch.amp.autocast(device_type, enabled=...)`: the flag is passed on, the dtype is
    not, and autocast's dtype is per thread, defaulting to float16 on CUDA. So a bf16 run computed its replicas in
    fp16, without loss scaling. Each replica runs here inside an autocast with the caller's dtype.
    """

    def parallel_apply(self, replicas, inputs, kwargs):
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [functools.partial(run_in_autocast, replica, device_type, dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


def run_in_autocast(module, device_type: str, dtype: torch.dtype, *args, **kwargs):
    with torch.autocast(device_type, dtype=dtype):
        return module(*args, **kwargs)


def use_tf32_matmuls(device_type: str, mixed_precision: str, tf32: bool) -> None:
    """TF32 tensor cores for the fp32 configs on GPUs (single, ddp, multinode, fsdp without bf16).

    torch 2.13.0 leaves fp32 matmuls in full fp32 by default ("highest"); on Ampere and newer, "high" runs them on
    TF32 tensor cores, several times faster, with a 10-bit mantissa in the products and fp32 accumulation: the
    precision fine-tuning with AdamW tolerates (Trainer's --tf32 does the same). The configs stay fp32 rather than
    bf16 so that the fp32 reference runs of the tests mean the same thing on CPU and GPU; --tf32 false turns it off.
    The bench's baselines apply the same rule (scripts/bench_baselines.py), so fp32 comparisons do the same math.
    """
    if device_type == "cuda" and mixed_precision == "no" and tf32:
        torch.set_float32_matmul_precision("high")


def offloads_optimizer(accelerator) -> bool:
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return False
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    return (zero.get("offload_optimizer") or {}).get("device", "none") in ("cpu", "nvme")


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets, Slurm), else all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_cpu_threads(accelerator, requested: int = 0) -> int:
    """Intra-op threads of a process that computes on CPU (or runs an offloaded optimizer step there); returns them.

    `accelerate launch` 1.15.0 sets OMP_NUM_THREADS=1 in every process unless the config says use_cpu or the user set
    it (commands/launch.py, num_cpu_threads_per_process), so a CPU run would train on one core of the machine, and
    DeepSpeed's CPU Adam (OpenMP) too. The rule: --cpu_threads N if given; else OMP_NUM_THREADS when it is above 1
    (a user's choice: accelerate's own default is 1); else the cores / the processes on this machine. A GPU run that
    keeps its optimizer on the GPU is left alone.
    """
    if accelerator.device.type != "cpu" and not offloads_optimizer(accelerator):
        return torch.get_num_threads()
    processes, cores = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), available_cores()
    if requested > 0:
        threads = requested
    elif int(os.environ.get("OMP_NUM_THREADS", "0") or 0) > 1:
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = max(1, cores // processes)
    torch.set_num_threads(threads)
    warning = oversubscription(threads, processes, cores)
    if warning and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warning: {warning}", file=sys.stderr)
    return threads


def oversubscription(threads: int, processes: int, cpus: int) -> str | None:
    """More intra-op threads on this machine than CPUs to run them: they take turns. Measured here (2 CPUs, DDP, the
    tiny model, torch 2.13.0): OMP_NUM_THREADS=2 in both processes made the step 217 ms against 104 ms with 1 each.
    Kept (the user chose the threads), but said; more processes than CPUs with one thread each are the launch's
    choice, not the threads'."""
    if threads <= 1 or threads * processes <= cpus:
        return None
    each = f"{processes} processes x {threads} threads" if processes > 1 else f"{threads} threads"
    return (f"{each} on {cpus} CPU{'s' if cpus > 1 else ''}: the threads take turns, which on CPU can take several "
            f"times as long; --cpu_threads {max(1, cpus // processes)} (or unset OMP_NUM_THREADS) gives each CPU one")


def clip_gradients(accelerator, model, max_norm: float):
    """Clip to `max_norm` and return the gradient norm before clipping, as a tensor: reading it is left to the
    logger, so the step does not wait for the device.

    Under DeepSpeed the engine has already clipped inside `accelerator.backward` (accelerate 1.15.0 steps the
    engine there), and `accelerator.clip_grad_norm_` would return the norm through `.item()`, a host sync every
    step; the engine's own value is read instead. FSDP2 returns a DTensor: its full value is the global norm.
    """
    engine = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if engine is not None:
        norm = engine.engine.get_global_grad_norm()
        return torch.as_tensor(norm if norm is not None else float("nan"), dtype=torch.float32)
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.detach().float()


class OverflowCheck:
    """Whether the optimizer step just taken was skipped on an fp16 loss-scale overflow, from what really happened.

    Accelerate 1.15.0 (`AcceleratedOptimizer.step`) calls it skipped when the GradScaler did not call the optimizer's
    `step`. torch 2.13.0's GradScaler always calls `step` of an optimizer that does its own inf check
    (`_step_supports_amp_scaling`: the fused AdamW, the recipe's default), passing `found_inf` to the kernel, which
    leaves the weights alone; so Accelerate reported every overflow as a real step: the schedule advanced and the
    non-finite guard stopped the run. With such an optimizer under a GradScaler the answer is read here instead: the
    scale `scaler.update()` (inside `optimizer.step()`) lowers on an overflow, compared with a copy taken before the
    step (a device copy, no host read); reading the comparison is the one host read per optimizer step. The
    scaler's own `found_inf` is gone by then: `update()` clears it. Everywhere else (no scaler: bf16, fp32,
    DeepSpeed's own loss scaler; the non-fused AdamW) Accelerate's answer is right and costs nothing more.
    `_scale` is GradScaler's private tensor in torch 2.13.0; `get_scale()` would read the device twice per step.
    """

    def __init__(self, accelerator, optimizer):
        self.accelerator = accelerator
        scaler = getattr(optimizer, "scaler", None)  # AcceleratedOptimizer keeps the Accelerator's GradScaler
        inner = getattr(optimizer, "optimizer", optimizer)
        self.scaler = scaler if getattr(inner, "_step_supports_amp_scaling", False) else None
        self.scale_before = None

    def before_step(self) -> None:
        """Called on a step's last micro-batch, before `optimizer.step()`."""
        if self.scaler is not None and getattr(self.scaler, "_scale", None) is not None:
            self.scale_before = self.scaler._scale.detach().clone()

    def skipped(self) -> bool:
        """Called after `optimizer.step()` of a step's last micro-batch: True when the step changed no weight."""
        if self.scale_before is None:
            return self.accelerator.optimizer_step_was_skipped
        lowered = bool(self.scaler._scale < self.scale_before)
        self.scale_before = None
        return lowered


STALE_LOCK_SECONDS = 120


def check_extension_locks(root: str | None = None) -> None:
    """Stop with one line when a DeepSpeed op build was killed and left its lock behind.

    torch 2.13.0 (`cpp_extension._jit_compile`, FileBaton) builds an op under `<extensions dir>/<op>/lock` and makes
    every later process wait on that file, without a timeout or a message, until it is deleted. A lock older than
    a build's first minutes that no process holds open is a dead builder's: report it instead of waiting forever.
    """
    from torch.utils.cpp_extension import get_default_build_root

    # Ops live in $TORCH_EXTENSIONS_DIR/<op>/ or, by default, <root>/py311_cpu/<op>/
    # (cpp_extension._get_build_directory).
    base = Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time()
    for lock in [*base.glob("*/lock"), *base.glob("*/*/lock")]:
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > STALE_LOCK_SECONDS and not held_open(lock):
            raise RecipeError(f"a DeepSpeed op build was interrupted and left {lock} behind; every DeepSpeed launch "
                              f"waits on it forever: delete it (rm {lock}) and launch again")


def held_open(path: Path) -> bool:
    """Whether a process of this machine has `path` open (Linux /proc; elsewhere assume it is)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    target = str(path.resolve())
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd) == target:
                    return True
        except OSError:
            continue
    return False



def explained(err: Exception) -> RecipeError | None:
    """`err` as the one-line RecipeError the user should read, or None when it is not one the recipe explains.

    torch 2.13.0's DDP raises "Expected to have finished reduction in the prior iteration" at the step after one in
    which a parameter got no gradient (an encoder with layers its classifier does not use, e.g. a DeBERTa-v2 config
    with relative attention but no pos_att_type), with a long message about find_unused_parameters.
    """
    if isinstance(err, RecipeError):
        return err
    if isinstance(err, RuntimeError) and "Expected to have finished reduction in the prior iteration" in str(err):
        return RecipeError("some parameters of the model got no gradient in a step, which DDP refuses: add "
                           "--ddp_find_unused_parameters (or remove the unused layers from the model's config)")
    return None


_HELD: list = []


def hold_until_exit(model) -> None:
    """Keep the prepared model alive until `exit_process` ends the process, which frees nothing.

    torch 2.13.0: freeing a DDP model frees its Reducer, whose destructor destroys the gloo process group it holds on
    the freeing thread, which holds the GIL, and joins gloo's run-loop thread there; that thread may be freeing a
    finished work whose tensors Python owns (an all-gather inside a barrier), which needs the GIL: a deadlock. Seen
    once in a suite run, when cls.main returned and its frame freed the model: rank 1 hung after the run had ended
    (gdb: the main thread in ~ProcessGroupGloo -> std::thread::join, pt_gloo_runloop in ~AsyncAllgatherWork ->
    decref -> take_gil). Held here, the model outlives main; a later call in the same process (tests, the bench's
    `alternate`) replaces it, and one process has no group to destroy."""
    _HELD[:] = [model]


def exit_process(code: int) -> NoReturn:
    """Leave the process with `code` once the run is over, without tearing the interpreter down.

    torch 2.13.0's gloo backend runs each collective on a native worker thread of its process group; the thread drops
    its reference to the finished work (and the tensors in it) a moment after the caller's wait returns, and freeing
    a tensor Python owned takes the GIL. If the main thread is finalizing the interpreter by then, CPython ends the
    worker thread (pthread_exit) and the unwind aborts the process: "terminate called without an active exception",
    exit -6, after final/ was written, so a scheduler requeues a finished run (pytorch/pytorch#190489); seen here
    after a zero3_offload launch and, in a suite run of the previous revision, after an FSDP2 one. Destroying the
    process groups first joins those threads only for groups nothing else holds: DeepSpeed 0.19.8 keeps its groups in
    deepspeed.utils.groups and on every ZeRO-3 parameter (ds_process_group). Measured with 2 gloo ranks ending on an
    all-gather on a group a module keeps (tests/exit_race_worker.py): 10 of 20 launches aborted at a normal exit, 0 of
    20 through this function. Python's exit functions (logging, file locks, tracker sessions) run first, as at any
    exit;     only the finalization is skipped.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
