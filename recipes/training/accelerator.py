"""The Accelerator of a launch config, and what it must agree on with the recipe's flags.

The recipe never names a strategy: the launch config picks it, and this module sets the same recipe up under it, on
GPUs and, for CI, on CPU processes: the Accelerator, DeepSpeed's "auto" values and FSDP's wrapped classes, the values
the engine really uses checked against the flags, TF32, CPU threads, nn.DataParallel. Library workarounds are in
recipes/workarounds/, one module per library.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

from recipes import RecipeError
from recipes.checks import launch_checks
from recipes.model import compilation, fsdp_wrap
from recipes.outputs import tracking
from recipes.workarounds import accelerate as accelerate_fixes
from recipes.workarounds import deepspeed as deepspeed_fixes
from recipes.workarounds import torch as torch_fixes


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
        torch_fixes.check_extension_locks()
        deepspeed_fixes.import_deepspeed_without_mlflow("mlflow" in tracking.tracker_names(cfg.report_to))
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
        # --streaming: every process reads the stream and keeps its slice (IterableDatasetShard); by default
        # Accelerate 1.15.0 would have rank 0 read all and dispatch the batches
        dataloader_config=DataLoaderConfiguration(non_blocking=not on_cpu,
                                                  dispatch_batches=False if cfg.streaming else None),
    )
    check_agreement(accelerator, cfg)  # a launch config's accumulation over --gradient_accumulation_steps
    use_tf32_matmuls(accelerator.device.type, accelerator.mixed_precision, cfg.tf32)
    set_cpu_threads(accelerator, cfg.cpu_threads)
    if on_cpu and fsdp:
        accelerate_fixes.rehearse_fsdp_on_cpu(accelerator)
    accelerate_fixes.reduce_fsdp_gradients_in_fp32(accelerator)
    accelerate_fixes.unwrap_without_importing_deepspeed()
    if cfg.torch_dtype == "float16" and accelerator.mixed_precision == "fp16" and not deepspeed:
        raise RecipeError("--torch_dtype float16 under fp16 mixed precision: torch 2.13.0's GradScaler cannot unscale "
                          "fp16 gradients; keep fp32 master weights (the default) or use bf16")
    if cfg.data_parallel and accelerator.num_processes > 1:
        raise RecipeError("--data_parallel runs in one process: use `python recipes/cls.py`, not a multi-process launch")
    return accelerator

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
    return torch_fixes.AutocastDataParallel(model)

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
