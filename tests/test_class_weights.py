"""--class_weights and --label_smoothing_factor (recipes/inputs/problem.py TrainingLoss, data.Loaders.window_weights).

In-process: the weighted loss sum over the window's weight sum is torch's weighted mean; balanced weights as
scikit-learn defines them; each window's weight sum, read from the sampler's order, equals the one of the batches the
sampler deals (world sizes, accumulation, partial windows, length grouping, a resumed epoch); one-line errors.
Launched (2 runs of the dropout-free tiny model, weights 1 and 3, smoothing 0.1): DDP on 2 processes with
accumulation 2 and a partial last window trains the losses of one process taking each window as one micro-batch,
and each record's weight sum is the one of the samples the ranks really trained.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from helpers import TINY_FLAGS, losses, rank_records, read_jsonl, run_recipe
from recipes import RecipeError, cls
from recipes.inputs import data, problem
from recipes.model.source import load_tokenizer


def config(**flags):
    return types.SimpleNamespace(**{"problem_type": "single_label", "class_weights": None,
                                    "label_smoothing_factor": 0.0, **flags})


class Labels(dict):
    """A stand-in for a datasets.Dataset: ds["labels"][:] is the label list."""

    def __init__(self, labels):
        super().__init__(labels=labels)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_weighted_sum_over_the_weight_sum_is_torchs_weighted_mean(smoothing):
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(12, 3, generator=gen), torch.randint(0, 3, (12,), generator=gen)
    loss = problem.TrainingLoss.of(config(class_weights="1,3,0.5", label_smoothing_factor=smoothing),
                                   ["a", "b", "c"], Labels(labels.tolist()))
    weights = loss.sample_weights(Labels(labels.tolist()))
    assert weights == [[1.0, 3.0, 0.5][y] for y in labels.tolist()]
    # a window of two micro-batches: their sums over the window's weight sum
    total = (loss(logits[:5], labels[:5]) + loss(logits[5:], labels[5:])) / sum(weights)
    expected = F.cross_entropy(logits, labels, weight=torch.tensor([1.0, 3.0, 0.5]), label_smoothing=smoothing)
    assert abs(total.item() - expected.item()) < 1e-6
    plain = problem.TrainingLoss.of(config(), ["a", "b", "c"], Labels([]))
    assert plain.sample_weights(Labels(labels.tolist())) is None
    assert plain(logits, labels).item() == problem.loss_sum("single_label", logits, labels).item()


def test_balanced_weights_and_multi_label_pos_weight():
    labels = [0, 0, 0, 1, 2, 2]  # scikit-learn's compute_class_weight("balanced"): 6 / (3 x count)
    loss = problem.TrainingLoss.of(config(class_weights="balanced"), ["a", "b", "c"], Labels(labels))
    assert loss.weights.tolist() == pytest.approx([6 / 9, 2.0, 1.0])
    multi = [[1, 0], [1, 1], [0, 0], [1, 0]]  # positives 3 and 1 of 4: pos_weight 1/3 and 3
    loss = problem.TrainingLoss.of(config(problem_type="multi_label", class_weights="balanced"), ["x", "y"],
                                   Labels(multi))
    assert loss.weights.tolist() == pytest.approx([1 / 3, 3.0]) and loss.sample_weights(Labels(multi)) is None
    logits, targets = torch.randn(4, 2), torch.tensor(multi, dtype=torch.float32)
    expected = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=loss.weights) * 4  # mean x samples
    assert abs(loss(logits, targets).item() - expected.item()) < 1e-5


@pytest.mark.parametrize("flags, names, labels, message", [
    (dict(problem_type="regression", class_weights="balanced"), ["score"], [0.5], "a regression has no classes"),
    (dict(class_weights="1,2,3"), ["a", "b"], [0, 1], "has 3 values for 2 labels"),
    (dict(class_weights="1,-2"), ["a", "b"], [0, 1], "every weight must be a positive number"),
    (dict(class_weights="1,x"), ["a", "b"], [0, 1], "'balanced' or one number per label"),
    (dict(class_weights="balanced"), ["a", "b"], [0, 0], "class 'b' has no training example"),
    (dict(problem_type="multi_label", class_weights="balanced"), ["x", "y"], [[1, 0]], "label 'y' is positive in no"),
    (dict(problem_type="multi_label", label_smoothing_factor=0.1), ["x", "y"], [[1, 0]], "single-label"),
])
def test_combinations_it_cannot_train_are_one_line_errors(flags, names, labels, message):
    with pytest.raises(RecipeError, match=message):
        problem.TrainingLoss.of(config(**flags), names, Labels(labels))


def dealt_window_sums(sampler, weights, accum):
    """The weight sum of each window from the batches the sampler deals (all ranks, round by round)."""
    batches = list(sampler)
    rounds = [batches[i:i + sampler.world_size] for i in range(0, len(batches), sampler.world_size)]
    windows = [rounds[i:i + accum] for i in range(0, len(rounds), accum)]
    return [sum(weights[j] for rnd in window for batch in rnd for j in batch) for window in windows]


@pytest.mark.parametrize("world, per_rank, accum, grouped", [(1, 7, 1, False), (2, 4, 3, False), (3, 5, 2, True)])
def test_window_weight_sums_are_the_dealt_samples_weights(world, per_rank, accum, grouped):
    n, gen = 101, torch.Generator().manual_seed(1)
    weights = torch.rand(n, generator=gen).tolist()
    lengths = torch.randint(1, 60, (n,), generator=gen).tolist()
    sampler = data.EvenShardBatchSampler(n, per_rank, world, seed=3, lengths=lengths if grouped else None,
                                         group_size=per_rank * world * accum if grouped else 0)
    plan = data.StepPlan.of(sampler, accum, epochs=2, max_steps=None)
    loaders = data.Loaders(None, None, sampler, plan, sample_weights=weights)
    for epoch in (0, 1):  # another order each epoch: other sums, the same sample counts
        sampler.set_epoch(epoch)
        sums = loaders.window_weights(epoch)
        assert sums == pytest.approx(dealt_window_sums(sampler, weights, accum), abs=1e-12)
        assert len(sums) == len(plan.windows(epoch))
    sampler.resume_at(1, 2 * per_rank * world + 1)  # --force_resume with another batch: mid-epoch, unaligned
    resumed = data.StepPlan.of(sampler, accum, epochs=2, max_steps=None, done_steps=5)
    loaders.plan = resumed
    sampler.set_epoch(1)
    assert loaders.window_weights(1) == pytest.approx(dealt_window_sums(sampler, weights, accum), abs=1e-12)
    assert data.Loaders(None, None, sampler, resumed).window_weights(1) is None


def test_label_smoothing_out_of_range_is_a_flag_error(tmp_path):
    proc = run_recipe(tmp_path / "out", "--label_smoothing_factor", "1.0", config=None, check=False)
    assert proc.returncode == 2 and "--label_smoothing_factor 1.0 must be in [0, 1)" in proc.stderr
    assert not (tmp_path / "out").exists()


# 200 samples, 2 ranks x 8 x accumulation 2 = 32 a step: 6 full steps and a partial 7th (8 samples)
RUN = ["--max_train_samples", "200", "--class_weights", "1,3", "--label_smoothing_factor", "0.1"]
DDP = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--record_ranks"]


def test_ddp_with_accumulation_trains_the_weighted_mean_of_each_window(no_dropout_model, tmp_path):
    flags = ["--model_name_or_path", str(no_dropout_model), *RUN]
    run_recipe(tmp_path / "ddp", *flags, *DDP)
    run_recipe(tmp_path / "one", *flags, "--per_device_train_batch_size", "32", config=None)  # a window a batch
    ddp, one = read_jsonl(tmp_path / "ddp" / "metrics.jsonl"), read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["samples"] for r in ddp] == [r["samples"] for r in one] == [32] * 6 + [8]
    delta = max(abs(a - b) for a, b in zip(losses(tmp_path / "ddp"), losses(tmp_path / "one")))
    print(f"weighted, smoothed: max |loss diff| DDP x accumulation vs one process = {delta:.2e}")
    assert delta <= 5e-7
    # each step's weight sum is the one of the 32 (or 8) samples the two ranks trained in its window
    cfg = cls.parse_config([*TINY_FLAGS, *flags])
    train, _, _ = data.prepare_datasets(cfg, load_tokenizer(cfg))
    labels = train["labels"][:]
    ranks = [[labels[i] for ids in rank["sample_ids"] for i in ids] for rank in rank_records(tmp_path / "ddp")]
    sizes = [len(ids) for ids in rank_records(tmp_path / "ddp")[0]["sample_ids"]]  # 8 x 12 and 4 per rank
    windows = [[y for rank in ranks for y in rank[sum(sizes[:k]):sum(sizes[:k + 2])]] for k in range(0, len(sizes), 2)]
    expected = [sum(3.0 if y == 1 else 1.0 for y in window) for window in windows]
    assert [r["weight_sum"] for r in ddp] == [r["weight_sum"] for r in one] == pytest.approx(expected)
    assert any(w != r["samples"] for w, r in zip(expected, ddp))  # the weights do move the normaliser
    evals = [read_jsonl(tmp_path / run / "eval.jsonl")[-1] for run in ("ddp", "one")]
    assert evals[0]["n_examples"] == evals[1]["n_examples"] == 101 and abs(evals[0]["loss"] - evals[1]["loss"]) <= 1e-5


def test_imbalanced_summary_pairs_each_seed_and_scores_what_weights_are_for(tmp_path):
    """scripts/measure/imbalanced.py's summary, on runs whose numbers are chosen here: per seed, balanced - plain of
    macro-F1, balanced accuracy (mean per-class recall, as scikit-learn's balanced_accuracy_score) and minority recall,
    each with a t interval over the seeds; the markdown states them."""
    from sklearn.metrics import balanced_accuracy_score

    from scripts.measure import imbalanced

    def run(seed, weighted, f1, neg, pos):
        return {"seed": seed, "weighted": weighted, "macro_f1": f1, "accuracy": 0.9, "ece": 0.01, "step": 10,
                "recall": {"negative": neg, "positive": pos}}

    runs = [run(1, False, 0.80, 1.0, 0.50), run(1, True, 0.78, 0.90, 0.75),
            run(2, False, 0.70, 0.95, 0.25), run(2, True, 0.74, 0.85, 0.75)]
    result = {"date": "2026-11-27", "data": {"train": {}, "validation": {}}, "flags": ["--a", "b"], "runs": runs}
    text = imbalanced.write_results(result, tmp_path / "r")
    # balanced accuracy of seed 1's plain run, from predictions with those recalls (4 negatives, 2 positives)
    assert balanced_accuracy_score([0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 0]) == (1.0 + 0.5) / 2
    bal = result["balanced_accuracy_gain"]
    assert bal["n"] == 2 and bal["mean"] == pytest.approx(((0.825 - 0.75) + (0.80 - 0.60)) / 2)
    assert result["macro_f1_gain"]["mean"] == pytest.approx((-0.02 + 0.04) / 2)
    assert result["minority_recall_gain"]["mean"] == pytest.approx((0.25 + 0.50) / 2)
    half = 12.706 * abs(0.075 - 0.2) / 2 ** 0.5 / 2 ** 0.5  # t(0.975, 1) x sample sd of the gains / sqrt(2)
    assert bal["ci95"] == pytest.approx([bal["mean"] - half, bal["mean"] + half], rel=1e-3)
    assert "- Balanced accuracy gain (balanced - none), paired by seed: mean +0.1375" in text
    assert (tmp_path / "r.json").is_file() and (tmp_path / "r.md").read_text() == text
