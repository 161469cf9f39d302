"""Fixtures: the offline tiny model, built once per session. The helpers tests share are in helpers.py."""
from __future__ import annotations

import os
import subprocess

import pytest

from helpers import PYTHON, REPO, TINY

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests rehearse every strategy on CPU processes (gloo). On a machine with GPUs the launches would take them:
# a 2-process config on a 1-GPU host would put both ranks on cuda:0, and the losses compared against CPU references
# would come from another device. Mocked-GPU tests patch torch.cuda themselves.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def tiny_model():
    """The offline model the README builds; built once if this checkout has none yet."""
    if not (TINY / "model.safetensors").exists():
        subprocess.run([PYTHON, "scripts/build_offline_model.py", "--output_dir", str(TINY)], cwd=REPO, check=True)
    return TINY
