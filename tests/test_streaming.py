"""--streaming (recipes/inputs/streaming.py): the stream's order, positions and refusals in process (no launch), and
the recipe streaming tiny CSV shards: exact resume after a SIGKILL of the whole 2-process launch, every row once per
pass, the shards' contract, a bad row named at the step it is met."""
from __future__ import annotations

import csv
import json
import random
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
    rows = take(streaming.RowStream(shards, COLUMNS, int, seed=42, block_rows=8, window=6,
                                    weight=lambda label: 3.0 if label == 1 else 1.0), 12)
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
