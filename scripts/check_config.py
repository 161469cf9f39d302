"""Check a launch config before a run: the accelerate YAML, the DeepSpeed JSON it names, the recipe flags, the model.

    python scripts/check_config.py accelerate_configs/zero2.yaml --model_name_or_path artifacts/tiny-roberta
    python scripts/check_config.py --all --model_name_or_path artifacts/tiny-roberta --per_device_train_batch_size 8

It checks the launch you will make: `--num_processes`, `--num_machines`, `--mixed_precision` and
`--deepspeed_config_file` take the place of the YAML's values, as they do on the `accelerate launch` line:

    python scripts/check_config.py accelerate_configs/zero2.yaml --num_processes 8 \
        --deepspeed_config_file ds_configs/zero2_fp16.json --model_name_or_path roberta-base

Prints "ok: <file>" (with the model's class and size when --model_name_or_path is given: its config is loaded, and
its modules built on the meta device, for every file) or one line per problem, and exits with status 1 when there
is a problem. With a model it also prints the memory one GPU needs: the model state at its peak for the file's
strategy (scripts/memory_model.py) plus the activations of one micro-batch of --max_length tokens, measured on CPU
in fp32 at micro-batches of 1 and 2 and scaled (scripts/measure/activation_memory.py); with --gpu_memory GIB a launch
that needs more is a problem. A Hub id this machine cannot reach stops it in one line within seconds. Run it from the
repository root: like `accelerate launch`, it reads `deepspeed_config_file` relative to the current directory.
Recipe flags are those of recipes/cls.py; the ones not given take its defaults. Without --model_name_or_path the
FSDP wrap classes are not checked. With --trainer_args (a TrainingArguments JSON) it also names each setting on which
a transformers.Trainer script and the YAML + DeepSpeed JSON pair disagree (recipes/checks/trainer_args_checks.py). The
checks themselves are recipes/checks/launch_checks.py, which the recipe also runs at start-up. A warning (fewer
processes than GPUs) is printed as "<file>: warning: ..." and does not change the exit status.

For a DeepSpeed YAML, --write_resolved PATH writes its DeepSpeed JSON with every "auto" filled for the recipe flags,
the model and --num_processes (default: the YAML's), as the recipe's launch would: a file that plain `deepspeed`
(no Accelerate, no Trainer) accepts. It is parsed by DeepSpeed's own config class before it is written.

    python scripts/check_config.py accelerate_configs/zero2_offload.yaml --write_resolved ds_zero2_offload.json \
        --model_name_or_path roberta-base --per_device_train_batch_size 16 --num_processes 8
"""
from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import fields
from pathlib import Path
from unittest import mock

from recipes.checks import launch_checks, trainer_args_checks
from recipes.cls import Config
from recipes.config import build_parser
from recipes.model import hub
from scripts import memory_model

REPO_ROOT = Path(__file__).resolve().parent.parent


def recipe_flags(recipe: dict) -> dict:
    """The recipe flags given, completed with the defaults of `Config` in recipes/cls.py."""
    return {**{f.name: f.default for f in fields(Config)}, **recipe}


def check_yaml(yaml_path: str, recipe: dict, model_path: str | None = None,
               warnings: list[str] | None = None, launch: dict | None = None) -> list[str]:
    """launch_checks.check_yaml with the recipe defaults for the flags not in `recipe`."""
    return launch_checks.check_yaml(yaml_path, recipe_flags(recipe), model_path, warnings, launch)


def check_launch_env(env: dict, recipe: dict, model=None) -> list[str]:
    """launch_checks.check_launch_env with the recipe defaults for the flags not in `recipe`."""
    return launch_checks.check_launch_env(env, recipe_flags(recipe), model)


def trainer_problems(trainer_args_path: str, yaml_path: str) -> list[str]:
    """Disagreements between a TrainingArguments JSON and a launch YAML with its DeepSpeed JSON."""
    import yaml

    try:
        trainer_args = json.loads(Path(trainer_args_path).read_text())
    except (OSError, ValueError) as err:
        return [f"cannot read the trainer arguments {trainer_args_path}: {' '.join(str(err).split())}"]
    return trainer_args_checks.trainer_args_problems(trainer_args, yaml.safe_load(Path(yaml_path).read_text()),
                                                     where=trainer_args_path)


def hidden_size(model_path: str | None) -> int:
    """What Accelerate 1.15.0 (`Accelerator._prepare_deepspeed`) reads from the model for the bucket sizes."""
    from transformers import AutoConfig

    if not model_path:
        raise ValueError("the DeepSpeed JSON sizes its buckets from the model (\"auto\"): give --model_name_or_path")
    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "hidden_size", None):
        return config.hidden_size
    if getattr(config, "hidden_sizes", None):
        return max(config.hidden_sizes)
    raise ValueError(f"{model_path} has no hidden_size: replace the \"auto\" bucket sizes by numbers")


def autos(config, prefix: str = "") -> list[str]:
    """The dotted keys whose value is still "auto"."""
    if not isinstance(config, dict):
        return []
    return [name for key, value in config.items() for name in
            ([f"{prefix}{key}"] if value == "auto" else autos(value, f"{prefix}{key}."))]


def resolved_deepspeed_config(yaml_path: str, recipe: dict, model_path: str | None = None,
                              num_processes: int | None = None,
                              deepspeed_config_file: str | None = None) -> tuple[dict, int, list[str]]:
    """The DeepSpeed JSON of a launch YAML with every "auto" filled as in the recipe's launch, for `num_processes`
    processes over all machines (default: the YAML's num_processes); that process count; notes for a user of plain
    `deepspeed`.

    The recipe fills the micro-batch and the clipping before `prepare` (training/accelerator.py fill_deepspeed_auto), then
    Accelerate 1.15.0 fills the rest inside `Accelerator.prepare` (`_prepare_deepspeed`): the same DeepSpeedPlugin
    calls run here. Offload configs get an "optimizer" section (AdamW, the recipe's values), since plain DeepSpeed
    refuses a torch optimizer with offload and nobody else swaps in its CPU Adam. ValueError when it cannot be done.
    """
    import yaml
    from accelerate.utils import DeepSpeedPlugin

    recipe = recipe_flags(recipe)
    launch = yaml.safe_load(Path(yaml_path).read_text())
    path = deepspeed_config_file or (launch.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if launch.get("distributed_type") != "DEEPSPEED" or not path:
        raise ValueError(f"{yaml_path} is not a DeepSpeed YAML with a deepspeed_config_file: nothing to resolve")
    world = num_processes or launch.get("num_processes") or 1
    raw = json.loads(Path(path).read_text())
    micro, clip = recipe["per_device_train_batch_size"], recipe["max_grad_norm"]
    plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(raw), gradient_accumulation_steps=recipe[
        "gradient_accumulation_steps"], gradient_clipping=clip, zero3_init_flag=False)
    plugin.set_mixed_precision(str(launch.get("mixed_precision") or "no"))  # as AcceleratorState does
    accum = plugin.get_value("gradient_accumulation_steps")
    fill = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": clip,
            "train_batch_size": micro * accum * world,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
    if any(plugin.is_auto(f"zero_optimization.{key}") for key in memory_model.auto_sizes(0)):
        fill.update({f"zero_optimization.{key}": value
                     for key, value in memory_model.auto_sizes(hidden_size(model_path)).items()})
    plugin.deepspeed_config_process(must_match=False, **fill)
    config = plugin.deepspeed_config
    # Accelerate 1.15.0 sets steps_per_print to float("inf") to silence DeepSpeed; json writes that as Infinity,
    # which is not JSON. Keep the file's own value.
    if "steps_per_print" in raw:
        config["steps_per_print"] = raw["steps_per_print"]
    else:
        del config["steps_per_print"]
    left = autos(config)
    if left:
        raise ValueError(f"{path}: no value for {', '.join(left)} (the recipe does not fill these either)")
    notes = [f"{path} resolved for {world} processes: train_batch_size {config['train_batch_size']} = micro-batch "
             f"{micro} x accumulation {accum} x {world}; DeepSpeed refuses it at another process count (resolve "
             f"again with --num_processes N); gradient_clipping {clip} is --max_grad_norm"]
    offload = (config["zero_optimization"].get("offload_optimizer") or {}).get("device", "none")
    if offload != "none" and "optimizer" not in config:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": recipe["learning_rate"], "betas": [0.9, 0.999],
                                                           "eps": 1e-8, "weight_decay": recipe["weight_decay"]}}
        notes.append("optimizer: DeepSpeed builds its CPU Adam (DeepSpeedCPUAdam, AdamW mode, a C++ op compiled "
                     "on first use) from the \"optimizer\" section (the recipe's lr, weight decay, torch's betas and "
                     "eps); pass deepspeed.initialize no optimizer (a torch one is refused with offload) and "
                     "model_parameters=<param groups>, or every parameter decays, biases and LayerNorm included; "
                     "the lr stays constant unless you pass lr_scheduler")
    return config, world, notes


def deepspeed_parse(config: dict, world: int):
    """DeepSpeed's own parse of `config` (`DeepSpeedConfig`, its batch assertion included) at `world` processes."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    class DataParallelWorld:  # the one question DeepSpeedConfig asks its mpu
        def get_data_parallel_world_size(self):
            return world

    # DeepSpeed 0.19.8's DeepSpeedConfig calls dist.get_rank() before it asks the mpu, and without a process group
    # that raises and it falls back to world size 1. Answer as rank 0 of a real group would.
    with mock.patch.object(deepspeed.comm, "get_rank", return_value=0):
        return DeepSpeedConfig(copy.deepcopy(config), mpu=DataParallelWorld())


def write_resolved(yaml_path: str, out: str, recipe: dict, model_path: str | None, num_processes: int | None,
                   deepspeed_config_file: str | None = None) -> int:
    """Write the resolved DeepSpeed JSON of `yaml_path` (or of `deepspeed_config_file`, as accelerate launch's flag
    would put it in the YAML's place) to `out`, or say why not (exit status 1)."""
    try:
        config, world, notes = resolved_deepspeed_config(yaml_path, recipe, model_path, num_processes,
                                                         deepspeed_config_file)
        deepspeed_parse(config, world)
    except (OSError, ValueError, AssertionError, TypeError) as err:
        print(f"{yaml_path}: cannot resolve: {' '.join(str(err).split())}")
        return 1
    Path(out).write_text(json.dumps(config, indent=2) + "\n")
    print("\n".join(f"note: {note}" for note in notes))
    print(f"wrote {out}")
    return 0


def fsdp_wrap_notes(yaml_path: str, recipe: dict) -> list[str]:
    """For an FSDP YAML that names no wrap class: the classes the recipe picks for the model, and what to name in
    the YAML when it is used outside the recipe (recipes/model/fsdp_wrap.py says why plain Accelerate differs)."""
    import yaml

    from recipes.model import fsdp_wrap

    launch = yaml.safe_load(Path(yaml_path).read_text()) or {}
    fsdp = launch.get("fsdp_config") or {}
    if launch.get("distributed_type") != "FSDP" or fsdp.get("fsdp_auto_wrap_policy") != "TRANSFORMER_BASED_WRAP" \
            or fsdp.get("fsdp_transformer_layer_cls_to_wrap"):
        return []
    loading = {k: recipe[k] for k in ("revision", "cache_dir", "trust_remote_code")}
    names, source = fsdp_wrap.wrap_classes(launch_checks.cached_skeleton(recipe["model_name_or_path"], **loading))
    return [f"FSDP shards {','.join(names)} one at a time ({source}); outside this recipe write "
            f"fsdp_transformer_layer_cls_to_wrap: {','.join(names)}"]


def model_note(recipe: dict) -> str:
    """' (model <name>: <class>, <size> parameters)': the model's config loaded and its modules built on the meta
    device, as the recipe will build them; '' without --model_name_or_path."""
    name = recipe.get("model_name_or_path")
    if not name:
        return ""
    loading = {k: recipe[k] for k in ("revision", "cache_dir", "trust_remote_code")}
    model = launch_checks.cached_skeleton(name, **loading)
    size = sum(p.numel() for p in model.parameters())
    return f" (model {name}: {type(model).__name__}, {size / 1e6:.1f} M parameters)"


def launch_settings(yaml_path: str, launch: dict) -> tuple[str, int, str, dict | None, bool]:
    """(memory_model strategy, processes, precision fp32|bf16, DeepSpeed JSON or None, FSDP's activation
    checkpointing) of a YAML that passed the checks, with the launch flags over its values."""
    import yaml

    data = launch_checks.with_launch_flags(yaml.safe_load(Path(yaml_path).read_text()), launch)
    world, precision = data.get("num_processes") or 1, data.get("mixed_precision") or "no"
    kind = data.get("distributed_type")
    if kind == "DEEPSPEED":
        ds = json.loads(Path(data["deepspeed_config"]["deepspeed_config_file"]).read_text())
        zero = ds.get("zero_optimization", {})
        offload = zero.get("offload_optimizer", {}).get("device", "none") != "none"
        strategy = f"zero{zero.get('stage', 0)}" + ("_offload" if offload and zero.get("stage") in (2, 3) else "")
        bf16 = (ds.get("bf16") or {}).get("enabled") in (True, "auto") and precision != "fp16"
        return strategy, world, "bf16" if bf16 else "fp32", ds, False
    fsdp = data.get("fsdp_config") or {}
    strategy = {"FSDP": "fsdp", "NO": "single"}.get(kind, "ddp")
    checkpointing = bool(fsdp.get("fsdp_activation_checkpointing")) if kind == "FSDP" else False
    return strategy, world, "bf16" if precision == "bf16" else "fp32", None, checkpointing


def memory_line(yaml_path: str, recipe: dict, launch: dict, gpu_memory: float | None,
                activations: dict) -> tuple[str, bool]:
    """The per-GPU memory of the launch: the model state at its peak (scripts/memory_model.py) and the activations
    of one micro-batch of --max_length tokens (scripts/measure/activation_memory.py, measured in fp32 at 1 and 2 and
    scaled; cached in `activations` by gradient checkpointing); and whether it fits in `gpu_memory` GiB."""
    from scripts.measure import activation_memory

    strategy, world, precision, ds, fsdp_checkpointing = launch_settings(yaml_path, launch)
    name, batch, length = recipe["model_name_or_path"], recipe["per_device_train_batch_size"], recipe["max_length"]
    shape = memory_model.shape_from_model(name, lora_r=recipe["lora_r"] if recipe["use_peft"] else None)
    state = memory_model.totals(memory_model.predict(strategy, shape, world, precision, ds_config=ds))["device_peak"]
    checkpointing = recipe["gradient_checkpointing"] or fsdp_checkpointing
    if checkpointing not in activations:
        # Measured in fp32 whatever the launch's precision: bf16 autocast on a CPU without bf16 matmuls took over 5
        # minutes for roberta-large here, fp32 29 s in all. A bf16 run keeps its matmul outputs in half the bytes.
        # A model of more than 2 layers is measured on its cuts to 1 and 2 (an 8B decoder would not fit the CPU).
        loading = {k: recipe[k] for k in ("revision", "cache_dir", "trust_remote_code")}
        activations[checkpointing] = activation_memory.layer_scaled_activations(name, batch, length, checkpointing,
                                                                                **loading)
    total = (state + activations[checkpointing]) / memory_model.GIB
    lora = f", LoRA r {recipe['lora_r']}" if recipe["use_peft"] else ""
    line = (f"per GPU ({strategy}, {world} processes, {precision}{lora}): model state "
            f"{state / memory_model.GIB:.2f} GiB at its peak + activations {activations[checkpointing] / memory_model.GIB:.2f} GiB (micro-batch "
            f"{batch} x {length} tokens, gradient checkpointing {'on' if checkpointing else 'off'}, measured in fp32"
            f"{': bf16 keeps less' if precision == 'bf16' else ''}) = {total:.2f} GiB")
    if gpu_memory is None:
        return line, True
    fits = total <= gpu_memory
    return line + (f", within --gpu_memory {gpu_memory:g}" if fits else
                   f", more than --gpu_memory {gpu_memory:g}: lower --per_device_train_batch_size (with more "
                   "--gradient_accumulation_steps), add --gradient_checkpointing, or shard more"), fits


def main(argv=None) -> int:
    # The recipe's own parser (its flags and their help, the --no_ ones included), unabbreviated as in the recipe: a
    # flag the recipe does not know fails here too.
    parser = build_parser()
    parser.prog, parser.allow_abbrev, parser.epilog = "scripts/check_config.py", False, None
    parser.description = "Check accelerate launch YAMLs, their DeepSpeed JSONs and the recipe flags. Run from the " \
        "repository root."
    parser.add_argument("yamls", nargs="*", help="accelerate launch YAML files")
    parser.add_argument("--all", action="store_true", help="check every file in accelerate_configs/")
    parser.add_argument("--trainer_args", help="a transformers TrainingArguments JSON (scripts/trainer_deepspeed.py "
                        "writes one) to check against each YAML and its DeepSpeed JSON")
    parser.add_argument("--write_resolved", metavar="PATH", help="write the YAML's DeepSpeed JSON with every "
                        "\"auto\" resolved (one DeepSpeed YAML), for plain `deepspeed`")
    # What `accelerate launch` takes beside --config_file for the same settings: given, it wins over the YAML's value
    parser.add_argument("--num_processes", type=int, help="as accelerate launch: processes (GPUs) over all machines "
                        "(default: the YAML's num_processes)")
    parser.add_argument("--num_machines", type=int, help="as accelerate launch: machines (default: the YAML's)")
    parser.add_argument("--mixed_precision", choices=("no", "fp16", "bf16", "fp8"),
                        help="as accelerate launch (default: the YAML's)")
    parser.add_argument("--deepspeed_config_file", help="as accelerate launch: the DeepSpeed JSON of a DeepSpeed YAML "
                        "(default: the YAML's deepspeed_config_file)")
    parser.add_argument("--gpu_memory", type=float, metavar="GIB", help="with --model_name_or_path: the GPU's memory "
                        "in GiB; a launch whose predicted model state + activations per GPU exceed it is a problem")
    parser.set_defaults(model_name_or_path=None)  # no model given: skip the FSDP wrap-class check
    args = parser.parse_args(argv)
    recipe = {f.name: getattr(args, f.name) for f in fields(Config)}
    shipped = sorted(os.path.relpath(p) for p in (REPO_ROOT / "accelerate_configs").glob("*.yaml"))
    paths = list(args.yamls) + (shipped if args.all else [])
    if not paths:
        parser.error("give YAML files or --all")
    if args.write_resolved and len(paths) != 1:
        parser.error("--write_resolved takes one YAML")
    why = args.model_name_or_path and hub.unreachable(args.model_name_or_path, args.cache_dir, args.revision)
    if why:  # a Hub id this machine cannot fetch: one line within seconds, not the Hub's retries per check
        print(f"error: {hub.cannot_fetch(args.model_name_or_path, why)}")
        return 1
    launch = {k: getattr(args, k) for k in launch_checks.LAUNCH_FLAGS if getattr(args, k) is not None}
    activations = {}  # the model's activation bytes per (checkpointing, precision), measured once
    failed = False
    for path in paths:
        warnings = []
        problems = launch_checks.check_yaml(path, recipe, args.model_name_or_path, warnings, launch)
        if args.trainer_args and not problems:
            problems = trainer_problems(args.trainer_args, path)
        for warning in warnings:
            print(f"{path}: warning: {warning}")
        memory = None
        if not problems and args.model_name_or_path:
            memory, fits = memory_line(path, recipe, launch, args.gpu_memory, activations)
            problems += [] if fits else [memory]
        print("\n".join(f"{path}: {problem}" for problem in problems) or f"ok: {path}{model_note(recipe)}")
        if not problems and args.model_name_or_path:
            notes = [*fsdp_wrap_notes(path, recipe), memory]
            print("".join(f"{path}: note: {note}\n" for note in notes), end="")
        failed |= bool(problems)
    if args.write_resolved and not failed:
        return write_resolved(paths[0], args.write_resolved, recipe, args.model_name_or_path, args.num_processes,
                              args.deepspeed_config_file)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
