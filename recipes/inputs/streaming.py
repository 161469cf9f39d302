"""--streaming: the training rows read from their files as the run goes, never tokenized or cached whole.

The stream is one endless sequence of passes over the shards (a file, or every .csv/.jsonl/.json/.parquet file of a
folder). Each pass takes the shards in an order drawn from (seed, pass), reads their rows one after the other, and
deals them in blocks of --stream_block valid rows, each block shuffled by (seed, pass, block) or, with
--group_by_length, cut into global batches of similar text lengths whose order is shuffled. Every process reads the
whole stream and keeps its own slice of each round (Accelerate's IterableDatasetShard: micro-batch x processes rows a
round), tokenizing only its own rows; so a step's rows are the same on any number of processes with the same global
batch, and each window of an optimizer step holds exactly global-batch rows (the last window of a pass runs on into
the next pass).

A position in the stream is the pass, the shard (its place in the pass's order), the raw row a block starts at, the
block's number in the pass and the rows already taken from it: a checkpoint stores the position after its step's
window, and a resumed stream starts there, reading only the one shard's rows before it. A row that cannot be read
(a malformed line, a missing column, an unreadable shard) stops the run in one line naming the shard and row.
"""
from __future__ import annotations

import csv
import json
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from recipes import RecipeError
from recipes.model.identity import file_sha256

SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")
ROW_ID = "row_id"  # a row's key in the stream: shard number (in name order) x SHARD_ROWS + raw row
SHARD_ROWS = 10 ** 9
WINDOW_WEIGHT = "window_weight_sum"  # batch key: the weight sum of the optimizer step's window (--class_weights)


def shard_files(source: str) -> list[Path]:
    """The shards of --train_file: the file itself, or a folder's data files in name order."""
    path = Path(source)
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise RecipeError(f"--streaming reads {', '.join(SUFFIXES)} files, not {path.name}")
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if files:
            return files
        raise RecipeError(f"--train_file {source}: the folder holds no {', '.join(SUFFIXES)} files")
    raise RecipeError(f"data file not found: {source}")


def identity(shards: list[Path]) -> dict:
    """The training data of a stream for the contract: each shard's name, size and SHA-256 (no row is parsed)."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in shards}


def read_rows(path: Path, columns: list[str]) -> Iterator[tuple[int, dict]]:
    """(raw row number, {column: value}) of each row of a shard, in file order; a row that cannot be read, or a
    shard without one of `columns`, is a RecipeError naming the shard and row."""
    row = -1
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            source = pq.ParquetFile(path)
            missing = [c for c in columns if c not in source.schema_arrow.names]
            if missing:
                raise RecipeError(f"shard {path.name}: no column '{missing[0]}' (columns: "
                                  f"{', '.join(source.schema_arrow.names)})")
            for batch in source.iter_batches(columns=columns):
                for values in batch.to_pylist():
                    row += 1
                    yield row, values
            return
        with open(path, newline="", encoding="utf-8") as f:
            if path.suffix == ".csv":
                reader = csv.DictReader(f, strict=True)  # a malformed line is an error, not a row
                missing = [c for c in columns if c not in (reader.fieldnames or [])]
                if missing:
                    raise RecipeError(f"shard {path.name}: no column '{missing[0]}' (columns: "
                                      f"{', '.join(reader.fieldnames or [])})")
                for values in reader:
                    row += 1
                    yield row, values
                return
            for line in f:
                row += 1
                if not line.strip():
                    continue
                values = json.loads(line)
                missing = [c for c in columns if c not in values]
                if missing:
                    raise RecipeError(f"shard {path.name} row {row}: no column '{missing[0]}'")
                yield row, values
    except GeneratorExit:  # closed early (a run's end): matched first, before any name that may be gone at exit
        raise
    except RecipeError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, csv.Error) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(f"shard {path.name} row {row + 1}: cannot be read ({first})") from None
    except Exception as err:  # noqa: BLE001 - pyarrow's errors share no base class with the others
        raise RecipeError(f"shard {path.name} row {row + 1}: cannot be read ({type(err).__name__}: {err})") from None


@dataclass(frozen=True)
class Position:
    """Where a stream is: `offset` rows taken from block `block` of pass `pass_`, which starts at raw row `raw_row`
    of the shard at place `shard` of the pass's order."""

    pass_: int = 0
    shard: int = 0
    raw_row: int = 0
    block: int = 0
    offset: int = 0

    def record(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, saved: Optional[dict]) -> "Position":
        return cls(**saved) if saved else cls()


class RowStream(torch.utils.data.IterableDataset):
    """The rows of every pass in the run's order (module docstring), endless, from `start`. Each row: its text(s),
    its encoded label, ROW_ID and, with `weighting` (rows in a window, the weight of a label), the weight sum of the
    window it belongs to."""

    def __init__(self, shards: list[Path], columns: dict, encode_label, seed: int, block_rows: int,
                 group_size: int = 0, weighting: Optional[tuple] = None, start: Position = Position()):
        self.shards, self.columns, self.encode_label, self.seed = shards, columns, encode_label, seed
        self.block_rows, self.group_size = block_rows, group_size
        self.window, self.weight = weighting or (1, None)
        self.start = start
        self.blocks: deque = deque(maxlen=64)  # (rows emitted before the block, its Position) of recent blocks
        self.emitted = 0

    def shard_order(self, pass_: int) -> list[int]:
        order = list(range(len(self.shards)))
        random.Random(self.seed * 1_000_003 + pass_).shuffle(order)
        return order

    def valid_rows(self, pass_: int, shard: int, raw_row: int) -> Iterator[tuple[int, int, dict]]:
        """(place in the pass's order, raw row, row) of the pass's rows with a text and a label, from that cursor."""
        order, wanted = self.shard_order(pass_), [c for c in self.columns.values() if c]
        for place in range(shard, len(order)):
            index = order[place]
            for raw, values in read_rows(self.shards[index], wanted):
                if place == shard and raw < raw_row:
                    continue
                text = values.get(self.columns["text"])
                label = values.get(self.columns["label"])
                if text is None or not str(text).strip() or label in (None, ""):
                    continue  # as the map-style path: an empty text or a missing label trains nothing
                row = {"text": str(text), "label": self.encode_label(label), ROW_ID: index * SHARD_ROWS + raw}
                if self.columns.get("text_pair"):
                    row["text_pair"] = str(values.get(self.columns["text_pair"]) or "")
                yield place, raw, row

    def ordered(self, rows: list[dict], pass_: int, block: int) -> list[dict]:
        """A block's rows in the run's order: shuffled, or grouped by length into global batches whose order is
        shuffled (--group_by_length)."""
        rng = random.Random((self.seed * 1_000_003 + pass_) * 1_000_003 + block)
        if not self.group_size:
            rng.shuffle(rows)
            return rows
        rows = sorted(rows, key=lambda r: -(len(r["text"]) + len(r.get("text_pair", ""))))
        groups = [rows[i:i + self.group_size] for i in range(0, len(rows), self.group_size)]
        rng.shuffle(groups)
        return [row for group in groups for row in group]

    def blocks_from(self, position: Position) -> Iterator[tuple[Position, list[dict]]]:
        """Each block from `position` on (its rows before `position.offset` included), pass after pass."""
        pass_, shard, raw_row, block = position.pass_, position.shard, position.raw_row, position.block
        while True:
            rows, cursor, found = [], None, 0
            for place, raw, row in self.valid_rows(pass_, shard, raw_row):
                cursor = cursor or Position(pass_, place, raw, block)
                rows.append(row)
                found += 1
                if len(rows) == self.block_rows:
                    yield cursor, self.ordered(rows, pass_, block)
                    rows, cursor, block = [], None, block + 1
            if rows:
                yield cursor, self.ordered(rows, pass_, block)
            if not found and (shard, raw_row) == (0, 0):  # a whole pass without a row: the stream would never end
                raise RecipeError("the training stream holds no row with a text and a label")
            pass_, shard, raw_row, block = pass_ + 1, 0, 0, 0

    def __iter__(self):
        self.emitted, pending = 0, []
        for cursor, rows in self.blocks_from(self.start):
            skip = self.start.offset if cursor == Position(self.start.pass_, self.start.shard, self.start.raw_row,
                                                           self.start.block) else 0
            self.blocks.append((self.emitted - skip, cursor))
            for row in rows[skip:]:
                pending.append(row)
                if len(pending) == self.window:  # a whole window: its weight sum is known before its first row
                    yield from self.with_weight(pending)
                    pending = []

    def with_weight(self, rows: list[dict]) -> Iterator[dict]:
        total = sum(self.weight(r["label"]) for r in rows) if self.weight else None
        for row in rows:
            self.emitted += 1
            yield {**row, WINDOW_WEIGHT: total} if total is not None else row

    def position(self, consumed: int) -> Position:
        """The stream's position after the first `consumed` rows this iterator emitted (the rows of the optimizer
        steps done since it started): a recent block's cursor and the rows taken from it."""
        for first, cursor in reversed(self.blocks):
            if first <= consumed:
                return Position(cursor.pass_, cursor.shard, cursor.raw_row, cursor.block, consumed - first)
        raise RecipeError(f"the stream's position after {consumed} rows is no longer known")


def label_parser(values: list):
    """How a label read from a CSV cell (always a string) becomes the type the validation set's labels have."""
    present = [v for v in values if v is not None]
    kind = type(present[0]) if present else str
    if kind is bool or kind not in (int, float):
        return lambda v: v
    return lambda v: kind(float(v)) if isinstance(v, str) and kind is int else kind(v) if isinstance(v, str) else v


@dataclass
class StreamData:
    """A --streaming run's data: the training shards and their identity, the tokenized evaluation set, the label
    names and how a row's label is encoded."""

    shards: list
    identity: dict
    eval: object
    names: list
    encode_label: object


def prepare(cfg, tokenizer) -> StreamData:
    """The shards of --train_file, and the map-style validation set (--validation_file), which gives the label
    names unless --label_names does; no training row is read here."""
    from recipes.inputs import data, problem

    shards = shard_files(cfg.train_file)
    raw = data.load_local({"validation": cfg.validation_file})["validation"]
    data.check_columns(raw, cfg, "validation")
    if cfg.label_names:
        names = [n.strip() for n in cfg.label_names.split(",") if n.strip()]
        cfg.problem_type = cfg.problem_type or problem.infer_problem_type(raw[cfg.label_column][:], False)
        encode_label = problem.LabelEncoder(cfg.problem_type, names, cfg.label_column)
    else:
        names, encode_label = data.label_space(raw, raw, cfg)
    evaluation = data.tokenize_split(raw, cfg, tokenizer, encode_label, "validation", cfg.max_eval_samples)
    parse = label_parser(raw[cfg.label_column][:])
    return StreamData(shards, identity(shards), evaluation.remove_columns(data.ROW), names,
                      lambda value: encode_label(parse(value), "training"))


class StreamCollator:
    """A micro-batch of raw rows: tokenized here (each process only its own rows), then padded or packed as the
    map-style batches are (data.collator); the window's weight sum and the row ids ride beside the tensors."""

    def __init__(self, cfg, tokenizer, with_ids: bool):
        from recipes.inputs import data

        self.cfg, self.tokenizer, self.with_ids = cfg, tokenizer, with_ids
        self.pad, self.sample_ids = data.collator(cfg, tokenizer), data.SAMPLE_IDS

    def __call__(self, rows: list[dict]) -> dict:
        pairs = [r["text_pair"] for r in rows] if "text_pair" in rows[0] else None
        encoded = self.tokenizer([r["text"] for r in rows], pairs, truncation=self.cfg.truncation,
                                 max_length=self.cfg.max_length)
        features = [{**{k: v[i] for k, v in encoded.items()}, "labels": row["label"],
                     **({self.sample_ids: row[ROW_ID]} if self.with_ids else {})} for i, row in enumerate(rows)]
        batch = self.pad(features)
        if WINDOW_WEIGHT in rows[0]:
            batch[WINDOW_WEIGHT] = rows[0][WINDOW_WEIGHT]
        return batch


class Endless:
    """Every window of an endless stream holds the global batch."""

    def __init__(self, samples: int):
        self.samples = samples

    def __getitem__(self, index: int) -> int:
        return self.samples


@dataclass
class StreamPlan:
    total_steps: int
    global_batch: int
    epochs: int = 1  # one endless epoch, which the loop leaves at the last step

    def windows(self, epoch: int) -> Endless:
        return Endless(self.global_batch)


@dataclass
class StreamLoaders:
    """A --streaming run's loaders, answering the training loop as data.Loaders does."""

    train: object
    eval: object
    stream: RowStream
    plan: StreamPlan
    round_rows: int  # rows of one micro-batch on every process
    extra_eval: list = field(default_factory=list)
    sample_weights: Optional[list] = None  # the weights ride on the rows (RowStream): nothing per sample here

    @property
    def group_size(self) -> int:
        return self.stream.group_size

    def batches(self, epoch: int, accelerator):
        return self.train, 0

    def window(self, epoch: int, micro: int, batch: dict, accum: int) -> tuple[int, Optional[float]]:
        return self.plan.global_batch, batch.pop(WINDOW_WEIGHT, None)

    def ends_epoch(self, micro: int) -> bool:
        return False

    def position(self, epoch: int, micro: int, end_of_epoch: bool) -> dict:
        """The checkpoint's place: the stream's position after micro-batch `micro` (rows of every process)."""
        return {"epoch": 0, "samples_in_epoch": 0, "stream": self.stream.position((micro + 1) * self.round_rows).record()}


def build_loaders(cfg, stream_data: StreamData, tokenizer, world_size: int, resume=None, with_ids: bool = False,
                  weights=None) -> StreamLoaders:
    """The loaders of a stream from `resume`'s position (the stream's start on a fresh run). `weights`: the class
    weight table (--class_weights, single-label)."""
    from recipes.inputs import data

    step_rows = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size
    columns = {"text": cfg.text_column, "label": cfg.label_column, "text_pair": cfg.text_pair_column}
    stream = RowStream(stream_data.shards, columns, stream_data.encode_label, cfg.seed, cfg.stream_block_rows,
                       group_size=step_rows if cfg.group_by_length else 0,
                       weighting=(step_rows, lambda label: weights[label]) if weights is not None else None,
                       start=Position.of(getattr(resume, "stream", None) if resume is not None else None))
    # The main process reads and tokenizes (a worker would read the whole stream again). An own generator, as the
    # map-style loaders have: a new iterator would otherwise draw its seed from the global RNG, shifting dropout.
    train = torch.utils.data.DataLoader(stream, batch_size=cfg.per_device_train_batch_size,
                                        collate_fn=StreamCollator(cfg, tokenizer, with_ids),
                                        generator=torch.Generator().manual_seed(cfg.seed))
    evaluation = data.eval_loader(cfg, stream_data.eval, tokenizer)
    return StreamLoaders(train, evaluation, stream, StreamPlan(cfg.max_train_steps, step_rows),
                         cfg.per_device_train_batch_size * world_size)


def flag_problems(cfg) -> list[str]:
    """What --streaming needs of the other flags, and what it cannot do on a stream of unknown length."""
    if not cfg.streaming:
        return ["--label_names declares a stream's labels (--streaming); a run on a dataset reads them from it"] \
            if cfg.label_names else []
    problems = []
    if not cfg.train_file:
        problems.append("--streaming reads --train_file (a file or a folder of shards)"
                        + ("; for a Hub dataset, download its files (huggingface-cli download --repo-type dataset) "
                           "and give their folder" if cfg.dataset_name or cfg.task_name else ""))
    if not cfg.validation_file:
        problems.append("--streaming needs --validation_file: the evaluation set is read whole, and a stream has no "
                        "split to hold out")
    if not cfg.max_train_steps:
        problems.append("--streaming needs --max_train_steps: a stream's length is not known before it ends")
    refused = {"max_train_samples": "the first N rows of a stream of unknown length",
               "validation_split_name": "a split of a stream", "do_predict": "predictions (recipes/predict.py "
               "predicts a file in a second run)", "predict_file": "predictions (recipes/predict.py predicts a file "
               "in a second run)"}
    problems += [f"--streaming with --{name}: {why}" for name, why in refused.items() if getattr(cfg, name)]
    if cfg.class_weights == "balanced":
        problems.append("--streaming with --class_weights balanced: the class counts need a pass over the stream; "
                        "give the weights, one number per label")
    if cfg.checkpointing_steps == "epoch":
        problems.append("--streaming with --checkpointing_steps epoch: a stream's passes are not optimizer-step "
                        "boundaries; give a number of steps")
    return problems
