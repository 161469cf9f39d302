"""Check a launch config before a run: the accelerate YAML, the DeepSpeed JSON it names, the recipe flags, the model.

    python scripts/check_config.py accelerate_configs/zero2.yaml --model_name_or_path artifacts/tiny-roberta
    python scripts/check_config.py --all --model_name_or_path artifacts/tiny-roberta --per_device_train_batch_size 8

Prints "ok: <file>" or one line per problem, and exits with status 1 when there is a problem. Run it from the
repository root: like `accelerate launch`, it reads `deepspeed_config_file` relative to the current directory.
Recipe flags are those of recipes/cls.py; the ones not given take its defaults. Without --model_name_or_path the
FSDP wrap classes are not checked. With --trainer_args (a TrainingArguments JSON) it also names each setting on which
a transformers.Trainer script and the YAML + DeepSpeed JSON pair disagree (recipes/trainer_args_checks.py). The
checks themselves are recipes/launch_checks.py, which the recipe also runs at start-up.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from recipes import launch_checks, trainer_args_checks
from recipes.cls import Config

REPO_ROOT = Path(__file__).resolve().parent.parent


def recipe_flags(recipe: dict) -> dict:
    """The recipe flags given, completed with the defaults of `Config` in recipes/cls.py."""
    return {**{f.name: f.default for f in fields(Config)}, **recipe}


def check_yaml(yaml_path: str, recipe: dict, model_path: str | None = None) -> list[str]:
    """launch_checks.check_yaml with the recipe defaults for the flags not in `recipe`."""
    return launch_checks.check_yaml(yaml_path, recipe_flags(recipe), model_path)


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


def main(argv=None) -> int:
    from transformers import HfArgumentParser

    # The recipe's own flags, unabbreviated as in the recipe: a flag the recipe does not know fails here too.
    parser = HfArgumentParser(Config, allow_abbrev=False, description="Check accelerate launch YAMLs, their "
                              "DeepSpeed JSONs and the recipe flags. Run from the repository root.")
    parser.add_argument("yamls", nargs="*", help="accelerate launch YAML files")
    parser.add_argument("--all", action="store_true", help="check every file in accelerate_configs/")
    parser.add_argument("--trainer_args", help="a transformers TrainingArguments JSON (scripts/trainer_deepspeed.py "
                        "writes one) to check against each YAML and its DeepSpeed JSON")
    parser.set_defaults(model_name_or_path=None)  # no model given: skip the FSDP wrap-class check
    args = parser.parse_args(argv)
    recipe = {f.name: getattr(args, f.name) for f in fields(Config)}
    shipped = sorted(os.path.relpath(p) for p in (REPO_ROOT / "accelerate_configs").glob("*.yaml"))
    paths = list(args.yamls) + (shipped if args.all else [])
    if not paths:
        parser.error("give YAML files or --all")
    failed = False
    for path in paths:
        problems = launch_checks.check_yaml(path, recipe, args.model_name_or_path)
        if args.trainer_args and not problems:
            problems = trainer_problems(args.trainer_args, path)
        print("\n".join(f"{path}: {problem}" for problem in problems) or f"ok: {path}")
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
