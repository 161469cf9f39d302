"""Fixtures: the offline tiny model, built once per session. The helpers tests share are in helpers.py."""
from __future__ import annotations

import os
import subprocess

import pytest

from helpers import PYTHON, REPO, TINY

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model():
    """The offline model the README builds; built once if this checkout has none yet."""
    if not (TINY / "model.safetensors").exists():
        subprocess.run([PYTHON, "scripts/build_offline_model.py", "--output_dir", str(TINY)], cwd=REPO, check=True)
    return TINY
