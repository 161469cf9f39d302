"""DeepSpeed 0.19.8: its import pulls in mlflow for an autotuner a training process never runs."""
from __future__ import annotations

import sys


def import_deepspeed_without_mlflow(logs_to_mlflow: bool) -> None:
    """Import deepspeed with mlflow hidden, unless this run logs to MLflow: deepspeed 0.19.8 imports
    `deepspeed.autotuning.autotuner` at `import deepspeed`, and that module imports mlflow whenever it is installed
    (the trackers extra), about 0.9 s per rank here, for its autotuning experiments only (the `deepspeed --autotuning`
    launcher; a training process never runs them). The autotuner catches the failed import (`has_mlflow = False`);
    afterwards `import mlflow` works again for whoever asks."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules or logs_to_mlflow:
        return
    sys.modules["mlflow"] = None  # `import mlflow` raises ModuleNotFoundError while this entry is None
    try:
        import deepspeed  # noqa: F401
    finally:
        del sys.modules["mlflow"]
