"""A Hugging Face Hub id on a machine that cannot reach the Hub: said in one line within seconds, with how to stage it.

Without this, huggingface_hub 2.4.0 retries the first request 5 times with growing waits before transformers 5.23
gives up (29.7 s for `--model_name_or_path roberta-base` on a machine without network, 2026-11-27). `unreachable`
asks once, with a short timeout, whether the Hub's host takes a connection, and only where the answer matters: a
name that is not a local path, not in the Hub cache, with offline mode off and no proxy in the environment (behind
a proxy a direct connection proves nothing, so the libraries decide as before).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0  # one TCP connection to the Hub's host: well under a second where the Hub is reachable
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
# Why a Hub id failed where `unreachable` did not decide it (offline mode, a proxy, the Hub's own answer)
NOT_SERVED = ("the Hugging Face Hub did not serve it (no such model, a gated or private one without a token, or no "
              "network)")
OFFLINE = "offline mode is on (HF_HUB_OFFLINE=1) and the Hub cache does not hold it"


def offline() -> bool:
    # huggingface_hub's own reading of the switch (constants._is_true): 1, ON, YES, TRUE in any case; read now, not
    # at import as its constant is, so that a test or a launcher that sets it later is seen.
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def cached(name: str, cache_dir=None, revision=None) -> bool:
    """Whether the Hub cache holds `name`'s config.json (for `revision`, default main)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json", cache_dir=cache_dir, revision=revision)
    except ValueError:  # not a valid repository id: the libraries' own error says so
        return False
    return isinstance(found, str)


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hub repository id (`name` or `org/name`), not of a path only."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def unreachable(name: str, cache_dir=None, revision=None) -> str | None:
    """Why `name` cannot come from the Hub here, or None when it may (or when that is not ours to decide)."""
    if Path(name).exists() or not is_hub_id(name) or offline() or any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    if cached(name, cache_dir, revision):
        return None
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as err:
        return f"the Hugging Face Hub ({host}) is unreachable from this machine ({err.strerror or err})"
    return None


def cannot_fetch(name: str, why: str) -> str:
    """The one line for a Hub id that cannot be loaded: what happened and how to bring the model (docs/gpus.md)."""
    folder = f"models/{name.rstrip('/').split('/')[-1]}"
    return (f"model '{name}' cannot be fetched: {why}; on a machine with network run "
            f"`hf download {name} --local-dir {folder}`, copy {folder} here and pass --model_name_or_path {folder} "
            "(docs/gpus.md); or try the offline model: make offline-model, then --model_name_or_path "
            "artifacts/tiny-roberta")
