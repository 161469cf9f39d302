"""Launch checks: the accelerate YAML, the DeepSpeed JSON it names, the launch environment and the model skeleton
(`launch_checks.py`, run by the recipe at start-up and by scripts/check_config.py), and a transformers.Trainer's
arguments held to the same rules (`trainer_args_checks.py`)."""
