"""A Hub id on a machine that cannot reach the Hub (recipes/model/hub.py): one line within seconds, saying how to stage
the model, from the recipe's start-up checks, scripts/check_config.py and scripts/memory_model.py; and no probe where it
cannot decide anything (a local folder, the Hub cache, offline mode, a proxy). In-process; the network is stood in
for, so the tests mean the same on a machine that has one."""
from __future__ import annotations

import socket
import time

import pytest

from recipes import RecipeError, cls
from recipes.model import hub, source
from scripts import check_config, memory_model

STAGING = "`hf download roberta-base --local-dir models/roberta-base`"


@pytest.fixture
def no_network(monkeypatch):
    """Online mode on a machine whose resolver knows no host; every connection attempt is counted."""
    attempts = []

    def refuse(address, timeout=None):
        attempts.append((address, timeout))
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for variable in hub.PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return attempts


def no_hub_request(monkeypatch):
    from transformers import AutoConfig

    def fail(*args, **kwargs):
        raise AssertionError("the Hub was asked after the probe said it is unreachable")

    monkeypatch.setattr(AutoConfig, "from_pretrained", fail)


def test_recipe_refuses_an_unreachable_hub_id_at_once_with_how_to_stage_it(no_network, monkeypatch, tmp_path):
    no_hub_request(monkeypatch)
    cfg = cls.parse_config(["--model_name_or_path", "roberta-base", "--output_dir", str(tmp_path / "out"),
                            "--cache_dir", str(tmp_path / "empty_cache")])
    started = time.perf_counter()
    with pytest.raises(RecipeError) as err:
        source.check_model_source(cfg)
    line = str(err.value)
    assert time.perf_counter() - started < 2.0  # no retries: the probe was refused at once
    assert no_network == [(("huggingface.co", 443), hub.PROBE_TIMEOUT_S)]
    assert "\n" not in line and line.startswith("model 'roberta-base' cannot be fetched: the Hugging Face Hub "
                                                "(huggingface.co) is unreachable from this machine")
    assert STAGING in line and "--model_name_or_path models/roberta-base (docs/gpus.md)" in line
    assert "artifacts/tiny-roberta" in line and not (tmp_path / "out").exists()


def test_no_probe_where_it_decides_nothing(no_network, monkeypatch, tmp_path, tiny_model):
    assert hub.unreachable(str(tiny_model)) is None  # a local folder
    # the Hub cache's layout (huggingface_hub 2.4.0): refs/main names the snapshot that holds config.json
    repo = tmp_path / "cache" / "models--org--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("a" * 40) / "config.json").write_text("{}")
    assert hub.cached("org/cached", tmp_path / "cache") and not hub.cached("org/other", tmp_path / "cache")
    assert hub.unreachable("org/cached", tmp_path / "cache") is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")  # behind a proxy a direct probe proves nothing
    assert hub.unreachable("org/other", tmp_path / "cache") is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: transformers fails fast by itself
    assert hub.unreachable("org/other", tmp_path / "cache") is None
    assert no_network == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert "unreachable" in hub.unreachable("org/other", tmp_path / "cache") and len(no_network) == 1


def test_scripts_stop_in_one_line(no_network, monkeypatch, capsys):
    no_hub_request(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        memory_model.main(["--model_name_or_path", "roberta-base", "--num_processes", "8"])
    assert str(stop.value).startswith("error: model 'roberta-base' cannot be fetched") and STAGING in str(stop.value)
    assert check_config.main(["accelerate_configs/fsdp.yaml", "--model_name_or_path", "roberta-base"]) == 1
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith("error: model 'roberta-base' cannot be fetched") and STAGING in line
    assert len(no_network) == 2


def test_offline_mode_keeps_its_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = cls.parse_config(["--model_name_or_path", "roberta-base", "--cache_dir", str(tmp_path / "empty_cache")])
    with pytest.raises(RecipeError) as err:
        source.check_model_source(cfg)
    assert str(err.value).startswith(f"model 'roberta-base' cannot be fetched: {hub.OFFLINE}; ")
    assert STAGING in str(err.value)


def test_a_missing_folder_is_not_sent_to_the_hub(no_network, tmp_path):
    missing = tmp_path / "models" / "roberta-base"  # a path no Hub id can be: the folder is what is missing
    assert not hub.is_hub_id(str(missing)) and hub.is_hub_id("FacebookAI/roberta-base")
    with pytest.raises(RecipeError) as err:
        source.check_model_source(cls.parse_config(["--model_name_or_path", str(missing)]))
    assert str(err.value) == f"model folder {missing} not found (nor a Hub id: `name` or `org/name`)"
    assert no_network == []


def test_a_tokenizer_hub_id_is_probed_too(no_network, tiny_model):
    cfg = cls.parse_config(["--model_name_or_path", str(tiny_model), "--tokenizer_name", "roberta-base"])
    with pytest.raises(RecipeError) as err:
        source.load_tokenizer(cfg)
    assert str(err.value).startswith("model 'roberta-base' cannot be fetched: the Hugging Face Hub (huggingface.co)")
    assert len(no_network) == 1
