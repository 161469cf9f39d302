"""A transformers.Trainer's arguments against an accelerate launch YAML and its DeepSpeed JSON: the settings both
sides hold must agree (the tutorials' warning for Trainer scripts started with `accelerate launch`).

Inside the Trainer, transformers 5.23.0 fills the JSON's "auto" values from TrainingArguments and refuses some
mismatches only after the model is built; the accelerate YAML it never sees, so a YAML that says DeepSpeed while
the arguments name no JSON (or another one) is not caught at all. Here each disagreement is one line.
"""
from __future__ import annotations

import json
from pathlib import Path

# DeepSpeed JSON key -> the TrainingArguments field that fills it when "auto" (transformers 5.23.0,
# HfTrainerDeepSpeedConfig.trainer_config_process).
DS_KEY_TO_TRAINER_ARG = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
}


def trainer_precision(args: dict) -> str:
    return "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "no"


def json_precision(ds: dict) -> str:
    for key in ("bf16", "fp16"):
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") in (True, "auto"):
            return key
    return "no"


def trainer_args_problems(args: dict, yaml_config: dict, where: str = "trainer args") -> list[str]:
    """Disagreements between Trainer arguments (`TrainingArguments.to_dict()`) and a parsed accelerate YAML."""
    problems = []
    kind = yaml_config.get("distributed_type")
    ds_file = (yaml_config.get("deepspeed_config") or {}).get("deepspeed_config_file") if kind == "DEEPSPEED" else None
    trainer_ds = args.get("deepspeed")
    if isinstance(trainer_ds, dict):
        problems.append(f"{where}: deepspeed is an inline dict; give the JSON file the YAML names ({ds_file})")
        return problems
    if ds_file and not trainer_ds:
        problems.append(f"{where}: deepspeed is not set but the YAML launches DeepSpeed with {ds_file}; "
                        f"pass deepspeed={ds_file}")
    elif trainer_ds and not ds_file:
        problems.append(f"{where}: deepspeed={trainer_ds} but the YAML's distributed_type is {kind}")
    elif ds_file and Path(trainer_ds).resolve() != Path(ds_file).resolve():
        problems.append(f"{where}: deepspeed={trainer_ds} but the YAML names {ds_file}")

    precision = trainer_precision(args)
    if ds_file:
        try:
            ds = json.loads(Path(ds_file).read_text())
        except (OSError, ValueError):
            return problems  # the config checker reports an unreadable JSON
        if json_precision(ds) != precision:
            problems.append(f"{where}: precision {precision} (bf16/fp16 arguments) but {ds_file} says "
                            f"{json_precision(ds)}")
        for key, arg in DS_KEY_TO_TRAINER_ARG.items():
            value = ds.get(key, "auto")
            if value != "auto" and arg in args and value != args[arg]:
                problems.append(f"{where}: {arg}={args[arg]} but {ds_file} has {key}={value}")
    else:
        yaml_precision = str(yaml_config.get("mixed_precision", "no"))
        if yaml_precision != precision:
            problems.append(f"{where}: precision {precision} (bf16/fp16 arguments) but the YAML's mixed_precision "
                            f"is {yaml_precision}")
    if yaml_config.get("use_cpu") is True and args.get("use_cpu") is False:
        problems.append(f"{where}: use_cpu=false but the YAML sets use_cpu: true")
    return problems
