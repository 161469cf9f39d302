"""Launch checks: an accelerate launch YAML, the DeepSpeed JSON it names, the recipe flags and the model, checked
before any work starts. One line per problem.

Two entry points: `check_yaml` reads the YAML (scripts/check_config.py is its command line), and
`check_launch_env` runs the same checks inside a launched process, where the YAML is gone and only the environment
`accelerate launch` made from it is left; the recipe calls it through `check_launch` on every rank at start-up.
Accelerate and DeepSpeed catch some of these mistakes themselves, but only once the data is tokenized and the model
built; some never.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from recipes import RecipeError
from recipes.model import hub, precision_support

# DeepSpeed ignores unknown top-level keys without a word, so a misspelt key silently falls back to its default.
# What our JSONs use, plus the common keys of the DeepSpeed configuration reference.
DS_TOP_KEYS = {
    "bf16", "fp16", "amp", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps", "gradient_clipping", "optimizer", "scheduler", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown",
    "memory_breakdown", "dump_state", "prescale_gradients", "gradient_predivide_factor", "communication_data_type",
    "data_types", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "checkpoint", "aio", "elasticity", "autotuning", "compile", "dataloader_drop_last",
}
# DeepSpeed refuses unknown zero_optimization keys, but only inside deepspeed.initialize, after the model is built.
DS_ZERO_KEYS = {
    "stage", "allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter", "reduce_bucket_size",
    "contiguous_gradients", "offload_optimizer", "offload_param", "sub_group_size", "round_robin_gradients",
    "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters", "use_multi_rank_bucket_allreduce",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients", "memory_efficient_linear",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
}
# deepspeed_config sub-keys that accelerate 1.15.0 refuses next to a deepspeed_config_file: the JSON owns them.
DS_KEYS_OWNED_BY_JSON = {"gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                         "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                         "zero3_save_16bit_model"}


@functools.lru_cache(maxsize=1)
def accelerate_keys() -> tuple[set, set, set]:
    """The keys accelerate reads: top-level YAML keys, fsdp_config sub-keys, deepspeed_config sub-keys."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    # `accelerate launch` copies each sub-key onto the launch flag of the same name and drops the others silently;
    # fp16 and dynamo_backend are old top-level spellings it still converts.
    groups = {g.title: {a.dest for a in g._group_actions} for g in launch_command_parser()._action_groups}
    top = set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
    return top, groups["FSDP Arguments"] | {"fsdp_ignored_modules"}, groups["DeepSpeed Arguments"]


def model_skeleton(model_path: str, num_labels: int = 2, **loading):
    """The sequence classifier of `model_path` built on the meta device: its modules and parameter shapes, no
    weights loaded and no memory used. `loading`: the recipe's loading flags (revision, cache_dir,
    trust_remote_code; source.loading_kwargs)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    why = hub.unreachable(model_path, loading.get("cache_dir"), loading.get("revision"))
    if why:
        raise RecipeError(hub.cannot_fetch(model_path, why))
    config = AutoConfig.from_pretrained(model_path, num_labels=num_labels, **loading)
    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(
            config, trust_remote_code=loading.get("trust_remote_code", False))


@functools.lru_cache(maxsize=8)
def cached_skeleton(model_path: str, revision: str = "main", cache_dir=None, trust_remote_code: bool = False):
    return model_skeleton(model_path, revision=revision, cache_dir=cache_dir, trust_remote_code=trust_remote_code)


def wrap_class_problems(wrap: str | None, model, where: str) -> list[str]:
    """Problems of the FSDP wrap classes a launch names (`wrap`, comma-separated) for `model`; with none named,
    whether the recipe can choose them (recipes/model/fsdp_wrap.py)."""
    from recipes.model import fsdp_wrap

    if not wrap:
        try:
            fsdp_wrap.wrap_classes(model)
        except RecipeError as err:
            return [str(err)]
        return []
    problems = []
    # Accelerate 1.15.0 splits the list on "," without stripping, so "A, B" looks for a class named " B".
    if any(name != name.strip() for name in str(wrap).split(",")):
        problems.append(f"FSDP wrap class list '{wrap}' has spaces: accelerate 1.15.0 does not strip them, "
                        "write it as A,B")
    class_names = {type(m).__name__ for m in model.modules()}
    layers = ", ".join(sorted(n for n in class_names if n.endswith(("Layer", "Block")))) or "none"
    names = [n.strip() for n in str(wrap).split(",") if n.strip()]
    problems += [f"FSDP wrap class '{name}' is not a module of {where} (its layer classes: {layers}); accelerate "
                 "would fail in prepare()" for name in names if name not in class_names]
    holders = fsdp_wrap.embedding_holders(model)
    problems += [f"FSDP wrap class '{name}' holds the input embedding, which accelerate 1.15.0 shards as a unit of "
                 "its own after the named classes: fully_shard fails in prepare(); leave it out"
                 for name in names if name in holders]
    return problems


def precision_problems(mixed_precision: str | None, ds: dict, path: str) -> list[str]:
    """Precision is set once, in the JSON: accelerate and DeepSpeed would each apply their own."""
    enabled = [k for k in ("bf16", "fp16") if isinstance(ds.get(k), dict) and ds[k].get("enabled") is True]
    problems = [f"{path} enables both bf16 and fp16"] if len(enabled) == 2 else []
    if mixed_precision in enabled:
        problems.append(f"mixed precision set twice: mixed_precision={mixed_precision} and {path} "
                        f"{mixed_precision}.enabled; keep it in the JSON only")
    elif enabled and mixed_precision not in (None, "no"):
        problems.append(f"mixed precision disagrees: mixed_precision={mixed_precision} but {path} enables "
                        f"{enabled[0]}; keep it in the JSON only")
    return problems


def deepspeed_problems(path: str, mixed_precision, mp_from_yaml: bool, recipe: dict, world: int | None) -> list[str]:
    """Problems of the DeepSpeed JSON at `path` and of the precision and batch settings around it."""
    try:
        ds = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return [f"deepspeed_config_file '{path}' not found (relative paths are read from where you launch)"]
    except json.JSONDecodeError as err:
        return [f"deepspeed_config_file '{path}' is not valid JSON (line {err.lineno}, column {err.colno}): {err.msg}"]
    if not isinstance(ds, dict):
        return [f"deepspeed_config_file '{path}' does not hold a JSON object"]
    problems = precision_problems(mixed_precision, ds, path)
    if mp_from_yaml and not problems:  # accelerate's own check, which counts even "no"
        problems.append(f"mixed_precision: {mixed_precision} next to a deepspeed_config_file: accelerate 1.15.0 "
                        "refuses any mixed_precision key there (even \"no\"); delete it, precision lives in the JSON")
    problems += [f"unknown key '{k}' in {path}" for k in sorted(set(ds) - DS_TOP_KEYS)]
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        problems.append(f"{path} has no zero_optimization section (accelerate requires one)")
    else:
        problems += [f"unknown key 'zero_optimization.{k}' in {path}" for k in sorted(set(zero) - DS_ZERO_KEYS)]
        gathers = zero.get("stage3_gather_16bit_weights_on_model_save",
                           zero.get("stage3_gather_fp16_weights_on_model_save"))
        if zero.get("stage") == 3 and gathers is not True:  # the recipe's save_final would fail after all the training
            problems.append(f"{path} is ZeRO-3 without stage3_gather_16bit_weights_on_model_save: true, so writing "
                            "final/ fails after training")
    for key, flag in (("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
                      ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                      ("gradient_clipping", "max_grad_norm")):
        value = ds.get(key, "auto")
        if value != "auto" and value != recipe[flag]:  # inside the engine the JSON wins: the flag would be ignored
            problems.append(f"{key}={value} in {path} but --{flag} {recipe[flag]}; set it to \"auto\" or pass "
                            f"--{flag} {value}")
    micro, accum = recipe["per_device_train_batch_size"], recipe["gradient_accumulation_steps"]
    half = next((k for k in ("bf16", "fp16") if isinstance(ds.get(k), dict) and ds[k].get("enabled") is True), None)
    accum_dtype = (ds.get("data_types") or {}).get("grad_accum_dtype")
    if half == "bf16" and accum > 1 and accum_dtype != "fp32":
        # DeepSpeed 0.19.8 (engine.get_data_types) accumulates in the model dtype unless told otherwise: the sum of
        # `accum` bf16 gradients keeps 8 bits of mantissa.
        fix = "add \"data_types\": {\"grad_accum_dtype\": \"fp32\"}"
        if isinstance(zero, dict) and zero.get("stage") == 1:  # engine._do_optimizer_sanity_check, 0.19.8
            fix += (" (DeepSpeed then runs ZeRO-1 through its BF16_Optimizer: one all-reduce after backward, not "
                    "overlapped) or use ZeRO-2 (ds_configs/zero2.json), which overlaps with fp32 accumulation")
        problems.append(f"{path} accumulates {accum} micro-batches of bf16 gradients in bf16; {fix}")
    total = ds.get("train_batch_size", "auto")
    if total != "auto" and world is not None and total != micro * accum * world:
        problems.append(f"train_batch_size={total} in {path} but micro-batch {micro} x accumulation {accum} x "
                        f"{world} processes = {micro * accum * world}")
    return problems


# deepspeed_config keys of a launch config without a JSON that `accelerate launch` (1.15.0) exports as ACCELERATE_*
# variables, and the recipe flag each would override (the Accelerator and DeepSpeed's plugin read the variables).
EXPORTED_KEYS = {"gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "max_grad_norm"}


def inline_deepspeed_problems(section: dict, recipe: dict) -> list[str]:
    """A YAML's own deepspeed_config values (what `accelerate config` writes for DeepSpeed without a JSON file)
    that differ from the recipe's flags: the run would use them instead (recipes/training/accelerator.py
    check_agreement)."""
    problems = []
    for key, flag in EXPORTED_KEYS.items():
        value = section.get(key)
        if value is None or str(value) == "auto" or float(value) == float(recipe[flag]):
            continue
        problems.append(f"deepspeed_config.{key}: {value} in the launch config but --{flag} {recipe[flag]}: accelerate "
                        f"launch exports it and the run would use {value}; delete the key (or set it to auto) or "
                        f"pass --{flag} {value}")
    return problems


def environment_problems(env, recipe: dict) -> list[str]:
    """ACCELERATE_* variables in this shell that the Accelerator would prefer to the recipe's flags."""
    problems = []
    for key, flag in EXPORTED_KEYS.items():
        variable = f"ACCELERATE_{key.upper()}"
        value = env.get(variable)
        if value is None or value == "auto" or float(value) == float(recipe[flag]):
            continue
        problems.append(f"{variable}={value} is set in this environment but --{flag} {recipe[flag]}: the run would use "
                        f"{value}; unset it or pass --{flag} {value}")
    return problems


LAUNCH_FLAGS = ("num_processes", "num_machines", "mixed_precision", "deepspeed_config_file")  # over the YAML's


def with_launch_flags(data: dict, launch: dict) -> dict:
    """A launch YAML's settings with the LAUNCH_FLAGS given (not None) in place of its own values."""
    launch = {k: v for k, v in launch.items() if v is not None}
    data = {**data, **{k: v for k, v in launch.items() if k != "deepspeed_config_file"}}
    if "deepspeed_config_file" in launch:
        data["deepspeed_config"] = {**(data.get("deepspeed_config") or {}),
                                    "deepspeed_config_file": launch["deepspeed_config_file"]}
    return data


def check_yaml(yaml_path: str, recipe: dict, model_path: str | None = None,
               warnings: list[str] | None = None, launch: dict | None = None) -> list[str]:
    """Problems of an accelerate launch YAML, the DeepSpeed JSON it names and the recipe flags; [] when clean.

    `recipe` holds every recipe flag (scripts/check_config.py fills the defaults). The FSDP wrap classes are checked
    against the model at `model_path` when it is given. A problem stops the launch; what does not (fewer processes
    than GPUs) is appended to `warnings` when the caller passes a list, and is not in the returned problems.
    `launch`: the `accelerate launch` flags of LAUNCH_FLAGS the user will add (None: not given), which take the place
    of the YAML's values as the launcher's own do (accelerate 1.15.0: a flag given wins over the config file).
    """
    import yaml
    from accelerate.utils import DistributedType, PrecisionType

    if not Path(yaml_path).is_file():
        return [f"config file not found: {yaml_path}"]
    try:
        data = yaml.safe_load(Path(yaml_path).read_text())
    except yaml.YAMLError as err:
        return [f"not valid YAML: {' '.join(str(err).split())}"]
    if not isinstance(data, dict):
        return ["not a YAML mapping of accelerate settings"]
    launch = {k: v for k, v in (launch or {}).items() if v is not None}
    if "deepspeed_config_file" in launch and data.get("distributed_type") != "DEEPSPEED":
        return [f"--deepspeed_config_file goes with a DeepSpeed YAML: with distributed_type "
                f"{data.get('distributed_type')} accelerate launch does not use it"]
    data = with_launch_flags(data, launch)
    fsdp = {k if k.startswith("fsdp") else f"fsdp_{k}": v for k, v in (data.get("fsdp_config") or {}).items()}
    ds_section = data.get("deepspeed_config") or {}
    problems = unknown_keys(data, fsdp, ds_section)

    # YAML 1.1 reads an unquoted NO / no as the boolean false, which accelerate then fails on.
    unquoted = "; an unquoted NO/no reads as YAML false: quote it"
    kind, mixed_precision = data.get("distributed_type"), data.get("mixed_precision")
    if str(kind) not in [t.value for t in DistributedType]:
        problems.append(f"unknown distributed_type '{kind}' (one of {', '.join(t.value for t in DistributedType)})"
                        + unquoted * isinstance(kind, bool))
    if mixed_precision is not None and str(mixed_precision) not in PrecisionType.list():
        problems.append(f"unknown mixed_precision '{mixed_precision}' (one of {', '.join(PrecisionType.list())})"
                        + unquoted * isinstance(mixed_precision, bool))
    for section, owner in (("fsdp_config", "FSDP"), ("deepspeed_config", "DEEPSPEED")):
        if data.get(section) and kind != owner:
            problems.append(f"{section} is set but distributed_type is {kind}, so it is ignored")

    world_problems, world = processes_problems(data, warnings)
    problems += world_problems
    if kind == "DEEPSPEED" and ds_section.get("deepspeed_config_file"):
        path = str(ds_section["deepspeed_config_file"])
        problems += [f"deepspeed_config.{k} next to deepspeed_config_file: accelerate 1.15.0 refuses it; set it in "
                     f"{path}" for k in sorted(DS_KEYS_OWNED_BY_JSON & set(ds_section))]
        problems += deepspeed_problems(path, mixed_precision, "mixed_precision" in data, recipe, world)
    if kind == "DEEPSPEED" and not ds_section.get("deepspeed_config_file"):
        problems += inline_deepspeed_problems(ds_section, recipe)
    problems += environment_problems(os.environ, recipe)
    if hasattr(os, "sched_getaffinity"):
        problems += launcher_binding_problems(os.environ, os.sched_getaffinity(0))
    ds_file = ds_section.get("deepspeed_config_file") if kind == "DEEPSPEED" else None
    problems += precision_support.bf16_problems(mixed_precision, ds_file)
    if kind == "FSDP":
        problems += fsdp_problems(fsdp, recipe, model_path)
    return problems


def unknown_keys(data: dict, fsdp: dict, ds_section: dict) -> list[str]:
    top_keys, fsdp_keys, ds_keys = accelerate_keys()
    return [*(f"unknown key '{k}' (accelerate launch refuses it)" for k in sorted(set(data) - top_keys)),
            *(f"unknown key 'fsdp_config.{k}' (accelerate ignores it)" for k in sorted(set(fsdp) - fsdp_keys)),
            *(f"unknown key 'deepspeed_config.{k}' (accelerate ignores it)" for k in sorted(set(ds_section) - ds_keys))]


def processes_problems(data: dict, warnings: list[str] | None) -> tuple[list[str], int | None]:
    """The YAML's process and machine counts against each other and the visible GPUs; and the processes (None
    when not given or not valid)."""
    problems, world, machines = [], data.get("num_processes"), data.get("num_machines", 1)
    if not isinstance(machines, int) or machines < 1:
        problems.append(f"num_machines={machines} must be an integer >= 1")
    if world is not None and (not isinstance(world, int) or world < 1):
        problems.append(f"num_processes={world} must be an integer >= 1")
        world = None
    elif world is not None and isinstance(machines, int) and machines >= 1 and world % machines:
        problems.append(f"num_processes={world} is not divisible by num_machines={machines}")
    if world is not None and isinstance(machines, int) and machines >= 1 and not data.get("use_cpu"):
        gpus = visible_gpus()
        problems += gpu_count_problems(world // machines, gpus)
        # "NO" is one process on one device by design (single.yaml); explicit gpu_ids chose the GPUs.
        if warnings is not None and data.get("distributed_type") != "NO" and str(data.get("gpu_ids", "all")) == "all":
            warnings += gpu_count_warnings(world // machines, gpus, machines)
    return problems, world


def fsdp_problems(fsdp: dict, recipe: dict, model_path: str | None) -> list[str]:
    """The fsdp_config's loading settings, and its wrap classes against the model (when `model_path` is given)."""
    problems = []
    if fsdp.get("fsdp_cpu_ram_efficient_loading") is True and fsdp.get("fsdp_sync_module_states") is False:
        problems.append("fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states: true (accelerate refuses)")
    wrap = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
    if model_path and fsdp.get("fsdp_auto_wrap_policy") == "TRANSFORMER_BASED_WRAP":
        loading = {k: recipe.get(k, d) for k, d in (("revision", "main"), ("cache_dir", None),
                                                     ("trust_remote_code", False))}
        try:
            problems += wrap_class_problems(wrap, cached_skeleton(str(model_path), **loading), model_path)
        except RecipeError as err:  # a Hub id this machine cannot fetch: the line says how to stage it
            problems.append(str(err))
        except (OSError, ValueError) as err:
            problems.append(f"cannot build the model skeleton from {model_path}: {' '.join(str(err).split())}")
    return problems


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_count_problems(per_machine: int, gpus: int) -> list[str]:
    """More processes than GPUs on a machine: accelerate 1.15.0 puts rank r on cuda:{local_rank % device_count}, so
    two ranks share a GPU and NCCL refuses the group (after the data and the model are loaded). No GPU at all is the
    CPU rehearsal, which is fine."""
    if gpus == 0 or per_machine <= gpus:
        return []
    return [f"{per_machine} processes per machine but {gpus} GPU(s) visible: two ranks would share a GPU, which NCCL "
            f"refuses; launch with --num_processes {gpus} (x machines) or expose more GPUs"]


def gpu_count_warnings(per_machine: int, gpus: int, machines: int = 1, launched: bool = True) -> list[str]:
    """Fewer processes than GPUs on a machine: the run is correct but leaves GPUs idle, and nothing else says so
    (every shipped YAML says num_processes: 2). `launched` is False for a plain `python recipes/cls.py`."""
    if gpus == 0 or per_machine >= gpus:
        return []
    total = f"{gpus * machines} ({gpus} per machine x {machines} machines)" if machines > 1 else str(gpus)
    fix = f"accelerate launch --num_processes {total}"
    if not launched:
        fix += " with a multi-process config (accelerate_configs/ddp.yaml), or pass --data_parallel"
    what = f"{per_machine} processes" if per_machine > 1 else "1 process"
    return [f"{what} on this machine but {gpus} GPUs visible: {gpus - per_machine} stay idle; to use them all: {fix}"]


# OpenMP variables that bind threads to CPUs when an OpenMP runtime loads: the standard ones and libgomp's, which
# torch's Linux wheels load (each of the three alone bound the initial thread here, torch 2.13.0), and Intel's, which
# binds only under Intel's runtime (KMP_AFFINITY left the affinity whole with torch's libgomp).
GOMP_BINDING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")
BINDING_VARIABLES = (*GOMP_BINDING_VARIABLES, "KMP_AFFINITY")
OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


def binding_problem(env: dict, affinity: set, cpus: int, parent_openmp: bool) -> str | None:
    """A launcher's own CPU binding inherited by the process it started: with a binding variable set, `accelerate
    launch` (or torchrun) imports torch, its OpenMP runtime binds the launcher's thread to the first CPU of its places,
    and every process it then starts inherits that one-CPU mask, so all the ranks' threads share it (measured here,
    2 CPUs, torch 2.13.0, accelerate 1.15.0: OMP_PROC_BIND=true OMP_PLACES=cores, the tiny model's median step
    92-96 against 56-59 ms, every thread of the run on CPU 0; the same variables with `python recipes/cls.py` cost
    nothing, 59 ms).
    `affinity`: the CPUs this process may run on; `cpus`: the machine's; `parent_openmp`: the parent process has an
    OpenMP runtime loaded. None when nothing is wrong."""
    binding = binding_settings(env)
    if not binding or not parent_openmp or len(affinity) >= cpus:
        return None
    return (f"{' '.join(binding)} is set, and the launcher that started this process loaded OpenMP, which bound the "
            f"launcher to CPU {','.join(map(str, sorted(affinity)))}; every process it starts inherits that, so the "
            f"run would compute on {len(affinity)} of this machine's {cpus} CPUs: {unbind(binding)}")


def binding_settings(env: dict, variables=BINDING_VARIABLES) -> list[str]:
    """The `variables` set in `env` as NAME=value; [] where none is, or OMP_PROC_BIND=false turns binding off."""
    if env.get("OMP_PROC_BIND", "").strip().lower() == "false":
        return []
    return [f"{key}={env[key]}" for key in variables if env.get(key)]


def unbind(binding: list[str]) -> str:
    return (f"unset {' '.join(b.split('=')[0] for b in binding)} for the launch (to bind each process, start it "
            "under taskset or numactl yourself)")


def launcher_binding_problems(env: dict, affinity: set) -> list[str]:
    """Before the launch (check_yaml, in the shell that will run `accelerate launch`): binding variables there make
    the launcher bind itself to one of the `affinity` CPUs and hand that one to every process (binding_problem).
    Only libgomp's variables: which runtime a launch loads is not known before it (torch's wheels: libgomp)."""
    binding = binding_settings(env, GOMP_BINDING_VARIABLES)
    if not binding or len(affinity) < 2:
        return []
    return [f"{' '.join(binding)} is set: accelerate launch loads OpenMP, which binds it to one CPU, and every "
            f"process it starts inherits that one of the {len(affinity)} CPUs here: {unbind(binding)}"]


def parent_loaded_openmp(pid: int | None = None) -> bool:
    """Whether the parent process (or `pid`) has an OpenMP runtime mapped (Linux /proc; False where unreadable)."""
    try:
        maps = Path(f"/proc/{pid or os.getppid()}/maps").read_text()
    except OSError:
        return False
    return any(name in maps for name in OPENMP_RUNTIMES)


def check_cpu_binding(env: dict) -> None:
    """binding_problem of this process, before any work: a one-line error on every rank."""
    if not hasattr(os, "sched_getaffinity") or not binding_settings(env):
        return
    problem = binding_problem(env, os.sched_getaffinity(0), os.cpu_count() or 1, parent_loaded_openmp())
    if problem:
        raise RecipeError(problem)


def check_devices(env: dict, data_parallel: bool | None = None) -> None:
    """Processes per machine against the visible GPUs, inside a launched process, before the process group forms:
    more processes than GPUs stop the run; fewer print one warning per machine (local rank 0) and the run goes on.

    A plain `python recipes/cls.py` (no LOCAL_WORLD_SIZE) is one process; it is told about idle GPUs only when the
    caller says whether --data_parallel is on (`data_parallel` not None), since DataParallel uses them all.
    """
    # torchrun (accelerate launch) sets LOCAL_WORLD_SIZE; DeepSpeed 0.19.8's own launcher (pdsh) sets LOCAL_SIZE.
    per_machine = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
    if per_machine and per_machine.isdigit():
        gpus = visible_gpus()
        problems = gpu_count_problems(int(per_machine), gpus)
        if problems:
            raise RecipeError("launch config: " + problems[0])
        world = env.get("WORLD_SIZE", per_machine)
        machines = int(world) // int(per_machine) if world.isdigit() and int(per_machine) > 0 else 1
        warnings = gpu_count_warnings(int(per_machine), gpus, max(machines, 1))
    elif "WORLD_SIZE" not in env and data_parallel is False:
        warnings = gpu_count_warnings(1, visible_gpus(), launched=False)
    else:
        warnings = []
    if env.get("RANK", "0") == "0":
        warnings += world_warnings(env, launch_request())
    if env.get("LOCAL_RANK", "0") == "0":
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)


def launch_request(parent_argv: list[str] | None = None) -> tuple[int, str] | None:
    """(processes, what) the `accelerate launch` that started this process asked for: its --num_processes, else its
    config file's num_processes; None when this process was not started by `accelerate launch` (plain python,
    torchrun, DeepSpeed's launcher, or not Linux).

    The launched process cannot learn it from its environment: accelerate 1.15.0's simple launcher (distributed_type
    NO, as in single.yaml) starts one process whatever --num_processes says and exports neither that number nor the
    config's. Its parent is the launch itself (the simple launcher and torchrun's agent both run inside it), whose
    command line is read from /proc and parsed with accelerate's own parser.
    """
    if parent_argv is None:
        try:
            parent_argv = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            return None
    starts = [i for i, arg in enumerate(parent_argv[:-1]) if Path(arg).name == "accelerate"
              and parent_argv[i + 1] == "launch"]
    starts += [i - 1 for i, arg in enumerate(parent_argv) if Path(arg).name == "accelerate-launch"]
    if not starts:
        return None
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        args, _ = launch_command_parser().parse_known_args(parent_argv[starts[0] + 2:])
    except SystemExit:  # not a command line this parser reads: nothing to compare
        return None
    if args.num_processes is not None:
        return args.num_processes, f"--num_processes {args.num_processes}"
    config_file = args.config_file or (default_config_file if Path(default_config_file).is_file() else None)
    if config_file is None:
        return None
    try:
        asked = load_config_from_file(config_file).num_processes
    except Exception:  # an unreadable config stopped the launch before this process would exist
        return None
    return (asked, f"num_processes {asked} in {config_file}") if isinstance(asked, int) and asked > 0 else None


def world_warnings(env: dict, request: tuple[int, str] | None) -> list[str]:
    """A launch that runs another number of processes than it asked for (single.yaml with --num_processes 2 runs
    one): one warning. A request that is honoured (ddp.yaml --num_processes 4) says nothing."""
    world = int(env.get("WORLD_SIZE", "1")) if str(env.get("WORLD_SIZE", "1")).isdigit() else 1
    if request is None or request[0] == world:
        return []
    return [f"the launch asked for {request[0]} processes ({request[1]}) but this run has {world}: a config with "
            "distributed_type NO (single.yaml) always runs one; for several use ddp.yaml or another multi-process "
            "config"]


def check_launch_env(env: dict, recipe: dict, model=None) -> list[str]:
    """The same checks inside a launched process, from the environment `accelerate launch` set; [] when clean.

    Local and cheap (one small JSON read, no collective), so every rank can call it before building anything big.
    `model` is the built model, before `prepare`; without it the FSDP wrap classes are not checked.
    """
    problems = []
    world = str(env.get("WORLD_SIZE", "1"))
    if not world.isdigit() or int(world) < 1:
        problems.append(f"WORLD_SIZE={world} must be an integer >= 1")
    elif env.get("ACCELERATE_USE_DEEPSPEED") == "true" and env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        # ACCELERATE_MIXED_PRECISION is always set ("no" by default); ACCELERATE_CONFIG_DS_FIELDS names the
        # DeepSpeed-related keys that came from the YAML, mixed_precision among them when the YAML set it.
        mixed_precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
        from_yaml = "mixed_precision" in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
        path = env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
        problems += deepspeed_problems(path, mixed_precision, from_yaml, recipe, int(world))
    ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") if env.get("ACCELERATE_USE_DEEPSPEED") == "true" else None
    problems += precision_support.bf16_problems(env.get("ACCELERATE_MIXED_PRECISION", "no"), ds_file)
    wrap = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")
    if env.get("ACCELERATE_USE_FSDP") == "true" and env.get("FSDP_AUTO_WRAP_POLICY") == "TRANSFORMER_BASED_WRAP" \
            and model is not None:
        problems += wrap_class_problems(wrap, model, "the model")
    return problems


def restart_warnings(env: dict, recipe: dict) -> list[str]:
    """What keeps an elastic agent's restart (`--max_restarts N`) from continuing this run; [] when nothing does.

    torch 2.13.0's agent gives each worker TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_USE_AGENT_STORE. The latter is
    "True" under the static rendezvous (always) and under c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the
    workers then build their process group in the agent's store, which outlives an attempt, and the restarted
    workers find the dead workers' keys there (gloo: `connectFullMesh ... Connection refused`, or a wait in
    init_process_group; NCCL exchanges its unique id through the same store). Warnings, not errors: a run that is
    never restarted trains correctly.
    """
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
        return []
    warnings = []
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.append("--max_restarts with the agent's store shared with the workers: a restarted worker group "
                        "cannot connect; launch with --rdzv_backend c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    if recipe.get("resume_from_checkpoint") != "auto":
        warnings.append("--max_restarts without --resume_from_checkpoint auto: a restarted worker does not continue "
                        "from the newest checkpoint")
    if not recipe.get("checkpointing_steps"):
        warnings.append("--max_restarts without --checkpointing_steps: a restart has no checkpoint to continue from")
    return warnings


def check_launch(cfg, model) -> None:
    """The checks of this launch (environment made by `accelerate launch`, flags, built model) or a RecipeError;
    the restart warnings printed once, by rank 0 of the first attempt."""
    env = dict(os.environ)
    problems = check_launch_env(env, asdict(cfg), model)
    if problems:
        raise RecipeError("launch config: " + "; ".join(problems))
    if env.get("RANK", "0") == "0" and env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        for warning in restart_warnings(env, asdict(cfg)):
            print(f"warning: {warning}", file=sys.stderr)
