"""The package layout holds: imports run one way (down recipes/'s floors) and in no circle, docs/layout.md lists every
file, no path edits, test machinery only in recipes/testing/ and inert unless asked for; a disk too full for the
suite's checkpoints stops it before any test, in one line."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

from helpers import REPO, disk_problem
from recipes.inputs import data
from recipes.testing.probe import Probe

PY_FILES = sorted(p for folder in ("recipes", "scripts", "tests") for p in (REPO / folder).rglob("*.py"))


def imported_modules(path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_sys_path_edits():
    """None, but tests/prewarm.py's fork setting sys.path[0] to its script's folder, as `python script.py` does."""
    offenders = [str(p.relative_to(REPO)) for p in PY_FILES
                 if "sys.path" in p.read_text() and p.name not in ("test_layout.py", "prewarm.py")]
    assert offenders == []


def test_recipes_import_nothing_from_scripts_or_tests():
    own = {p.stem for p in (REPO / "tests").glob("*.py")} | {"scripts"}
    for path in (REPO / "recipes").rglob("*.py"):
        bad = {m for m in imported_modules(path) if m.split(".")[0] in own}
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def project_imports(path) -> set[str]:
    """The project modules `path` imports anywhere in it (a function's own import counts too), as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)  # from recipes.inputs.data import SAMPLE_IDS
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # from recipes.inputs import data
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.split(".")[0] in ("recipes", "scripts")}


def test_no_import_circles_in_recipes_or_scripts():
    """Each module's project imports, function-level ones included, form no circle (flag_checks <-> kernels and
    bench <-> bench_compile were broken): a module can be read, tested and moved without the ones that need it."""
    modules = {}
    for path in (p for p in PY_FILES if p.parts[-2] != "tests" and "tests" not in p.relative_to(REPO).parts):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: {m for m in project_imports(path) if m in modules and m != name} for name, path in modules.items()}
    assert graph["recipes.cls"] and graph["scripts.measure.bench_compile"]  # the reading sees imports
    state, circles = {}, []

    def visit(name, trail):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circles.append(trail[trail.index(target):] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


# recipes/'s floors, top to bottom (docs/layout.md): a module imports only from floors below its own, or from its own
# package. testing/ sits under cls.py, the one module that imports it.
FLOORS = [["recipes.cls", "recipes.export", "recipes.predict"], ["recipes.testing"], ["recipes.config"],
          ["recipes.flag_checks"], ["recipes.training", "recipes.checkpoints", "recipes.serving"], ["recipes.outputs"],
          ["recipes.checks", "recipes.inputs"], ["recipes.model", "recipes.metrics", "recipes.workarounds"],
          ["recipes", "recipes.hooks"]]


def recipes_unit(dotted: str) -> str:
    """The floor's unit of a recipes module: its package below recipes/, or the top-level module itself."""
    parts = dotted.split(".")
    return ".".join(parts[:2])


def test_recipes_packages_import_down_their_floors():
    floor = {unit: i for i, units in enumerate(FLOORS) for unit in units}
    up = []
    for path in (REPO / "recipes").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if "metrics" in parts[1:-1]:
            continue  # the evaluate modules are loaded by path
        unit = recipes_unit(name)
        assert unit in floor, f"{path.relative_to(REPO)}: a new package or top-level module; give it a floor"
        for target in project_imports(path):
            other = recipes_unit(target)
            if other in floor and other != unit and floor[other] <= floor[unit]:
                up.append(f"{name} -> {target}")
    assert up == []
    importers = {str(p.relative_to(REPO)) for p in (REPO / "recipes").rglob("*.py")
                 if any(t.startswith("recipes.testing") for t in project_imports(p)) and "testing" not in p.parts}
    assert importers == {"recipes/cls.py"}


def test_no_function_in_recipes_is_longer_than_60_lines_or_takes_more_than_8_parameters():
    """A function a reader takes in at once: at most 60 lines and 8 parameters (self, *args and **kwargs count as
    one each, self not at all), in every module of recipes/."""
    found = []
    for path in sorted((REPO / "recipes").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                count = len(names) - (names[:1] in (["self"], ["cls"])) + bool(a.vararg) + bool(a.kwarg)
                lines = node.end_lineno - node.lineno + 1
                if lines > 60 or count > 8:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines, {count} params")
    assert found == []


def test_layout_page_lists_every_file():
    """docs/layout.md names every file of recipes/ (a package's modules by name under its folder), scripts/, tests/,
    accelerate_configs/ and docs/, and nothing that is not there."""
    listed, package, fenced = set(), None, False
    for line in (REPO / "docs" / "layout.md").read_text().splitlines():
        fenced ^= line.startswith("```")
        name = line.strip().split("  ")[0]
        if not fenced or not name or line.startswith(("```", " " * 4)):
            continue  # prose, a fence, a description's next line
        if line.startswith("  "):
            listed.add(package + name)
        else:
            listed.add(name)
            package = name if name.endswith("/") else package
    files = {str(p.relative_to(REPO)) for folder in ("scripts", "scripts/measure", "tests", "docs")
             for p in (REPO / folder).glob("*")
             if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".md")}
    files |= {f"accelerate_configs/{p.name}" for p in (REPO / "accelerate_configs").glob("*.yaml")}
    for path in (REPO / "recipes").rglob("*"):
        rel = path.relative_to(REPO)
        if rel.parts[1:2] == ("metrics",) and len(rel.parts) > 3 or "__pycache__" in rel.parts:
            continue
        if path.is_dir():
            files.add(f"{rel}/")
        elif path.suffix == ".py" and (path.name != "__init__.py" or len(rel.parts) == 2 or "metrics" in rel.parts):
            files.add(str(rel))
    missing, stale = sorted(files - listed), sorted(p for p in listed if "*" not in p and not (REPO / p).exists())
    assert (missing, stale) == ([], []), "docs/layout.md lacks these files / names these that are not there"


def test_fault_variable_is_read_only_by_the_probe():
    readers = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").rglob("*.py") if "CLS_FAULT" in p.read_text())
    assert "recipes/testing/probe.py" in readers and all(r.startswith("recipes/testing/") for r in readers), readers


def test_probe_is_inert_by_default(tiny_model, monkeypatch):
    """Without --record_ranks and CLS_FAULT: the data carry no sample ids, and no probe call changes anything."""
    from transformers import AutoTokenizer

    from recipes.cls import parse_config

    monkeypatch.delenv("CLS_FAULT", raising=False)
    cfg = parse_config(["--model_name_or_path", str(tiny_model), "--max_train_samples", "40", "--max_eval_samples",
                        "8", "--per_device_train_batch_size", "8"])
    probe = Probe.for_run(cfg, rank=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    train_ds, eval_ds, _ = data.prepare_datasets(cfg, tokenizer, with_ids=probe.wants_sample_ids)
    assert data.SAMPLE_IDS not in train_ds.column_names and data.SAMPLE_IDS not in eval_ds.column_names
    loaders = data.build_loaders(cfg, train_ds, eval_ds, tokenizer, world_size=1)
    batches = list(loaders.train)
    assert len(batches) == 5 and all(set(b.keys()) == {"input_ids", "attention_mask", "labels"} for b in batches)
    before = {k: v.clone() for k, v in batches[0].items()}
    probe.batch(batches[0])
    probe.step(1)
    probe.saved(1)
    assert batches[0].keys() == before.keys() and probe.sample_ids == []


def test_probe_records_ids_as_a_list_beside_the_batch(tiny_model):
    from transformers import AutoTokenizer

    from recipes.cls import parse_config

    cfg = parse_config(["--model_name_or_path", str(tiny_model), "--max_train_samples", "40", "--max_eval_samples",
                        "8", "--per_device_train_batch_size", "8", "--record_ranks"])
    probe = Probe.for_run(cfg, rank=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    train_ds, eval_ds, _ = data.prepare_datasets(cfg, tokenizer, with_ids=probe.wants_sample_ids)
    loaders = data.build_loaders(cfg, train_ds, eval_ds, tokenizer, world_size=1)
    for batch in loaders.train:
        assert isinstance(batch[data.SAMPLE_IDS], list)
        probe.batch(batch)
        assert data.SAMPLE_IDS not in batch
    assert sorted(i for ids in probe.sample_ids for i in ids) == list(range(40))


@pytest.mark.parametrize("fault,where,step,dies", [("step:3:1", "step", 3, False), ("step:3:0", "step", 3, True),
                                                   ("save:3:0", "step", 3, False), ("save:3:0", "save", 3, True)])
def test_probe_fault_matches_where_step_and_rank(monkeypatch, fault, where, step, dies):
    killed = []
    monkeypatch.setattr("recipes.testing.probe.os.kill", lambda pid, sig: killed.append(sig))
    probe = Probe(record=False, rank=0, fault=fault)
    (probe.step if where == "step" else probe.saved)(step)
    assert bool(killed) == dies


def test_a_disk_too_full_for_the_checkpoints_is_one_line_before_any_test(tmp_path):
    """conftest's pytest_configure refuses the run, in one line, where helpers.disk_problem finds too little space."""
    free = shutil.disk_usage(tmp_path).free / 2**30
    assert disk_problem(tmp_path / "not" / "made", need_gb=0) is None  # the nearest existing folder is measured
    problem = disk_problem(tmp_path, need_gb=free + 1000)
    assert problem.startswith(f"make test needs about {free + 1000:.0f} GB free under {tmp_path}")
    assert "\n" not in problem
    # the real hook, in a pytest of its own: its controller stops before collecting anything
    code = ("import helpers, sys; helpers.TEST_DISK_GB = 10.0 ** 9; import pytest; "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--basetemp', {str(tmp_path / 'b')!r}, "
            "'tests/test_layout.py::test_no_sys_path_edits']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "ERROR: make test needs about 1000000000 GB free under" in proc.stderr
