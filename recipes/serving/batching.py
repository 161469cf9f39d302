"""Batches of a bounded window of rows: sorted by token count so that each batch pads little, dealt round-robin to the
processes, and the logits put back in input order by the row index that travels with them.

The window bounds memory (its token ids and logits, never the file's), and sorting inside it keeps most of the gain
of sorting the whole file: rows of a window of a few thousand spread over every length the file has.
"""
from __future__ import annotations

import torch

from recipes.inputs import data


def sorted_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices into the window, longest first (ties in input order), cut into batches."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def collator(tokenizer, max_length):
    """The recipe's evaluation collator: each batch padded to its longest row."""
    return data.Collator(tokenizer, max_length)


def window_logits(runner, collate, encodings, batch_size: int, rank: int = 0, world: int = 1):
    """(indices into the window, their logits) of this process's batches: batches rank, rank + world, ..."""
    names = [name for name in encodings.keys() if name in runner.input_names]
    batches = sorted_batches([len(ids) for ids in encodings["input_ids"]], batch_size)[rank::world]
    rows, logits = [], []
    for batch in batches:
        rows += batch
        logits.append(runner(collate([{name: encodings[name][i] for name in names} for i in batch])))
    return torch.tensor(rows, dtype=torch.long), torch.cat(logits) if logits else None


def logits_in_input_order(runner, collate, encodings, batch_size: int) -> torch.Tensor:
    """Every row's logits, in one process, in input order."""
    rows, logits = window_logits(runner, collate, encodings, batch_size)
    ordered = torch.empty_like(logits)
    ordered[rows] = logits
    return ordered
