"""The recipe run for real, tiny: DDP on 2 processes synchronises, eval counts every example once, the loss goes
down, final/ reloads and reproduces the reported accuracy, and bad input fails with one clear line."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import eval_loader, losses, no_gpu, rank_records, read_jsonl, run_recipe
from recipes import RecipeError, cls
from recipes.inputs import data
from recipes.metrics import compute_metrics, load_metrics

N_TRAIN, N_EVAL = 256, 101


@pytest.fixture(scope="module")
def ddp_run(tiny_model, tmp_path_factory):
    """8 epochs of DDP on 2 processes over 64 examples: enough steps for the loss to fall by memorisation."""
    out = tmp_path_factory.mktemp("ddp")
    run_recipe(out, "--max_train_samples", "64", "--num_train_epochs", "8", "--learning_rate", "3e-3",
               "--record_ranks")
    return out


@pytest.mark.multiproc
@no_gpu  # expects MULTI_CPU over gloo
def test_ddp_ranks_are_synchronised(ddp_run):
    ranks = rank_records(ddp_run)
    assert [r["rank"] for r in ranks] == [0, 1]
    # Every parameter identical on both ranks: with cpu=False on a CPU box each rank would train alone and differ.
    assert ranks[0]["param_sums"] == ranks[1]["param_sums"]
    # Within each epoch, the ranks saw disjoint samples that together cover the training set exactly once.
    steps_per_epoch = len(ranks[0]["sample_ids"]) // 8
    for epoch in range(8):
        window = slice(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
        ids = [[i for batch in r["sample_ids"][window] for i in batch] for r in ranks]
        assert not set(ids[0]) & set(ids[1])
        assert sorted(ids[0] + ids[1]) == list(range(64))


@pytest.mark.multiproc
def test_eval_counts_every_example_once_and_loss_decreases(ddp_run):
    evals = read_jsonl(ddp_run / "eval.jsonl")
    assert [e["n_examples"] for e in evals] == [N_EVAL] * 8  # 101 over 2 ranks x batch 16: uneven on purpose
    curve = losses(ddp_run)
    assert len(curve) == 16  # 64 examples / (16 x 2) = 2 steps per epoch, 8 epochs
    assert curve[0] == pytest.approx(0.693, abs=0.05)  # ln 2: an untrained binary classifier
    assert sum(curve[-4:]) / 4 < 0.6 * sum(curve[:4]) / 4, curve


@pytest.mark.multiproc
@no_gpu  # expects MULTI_CPU
def test_run_records_follow_the_contract(ddp_run):
    resolved = json.loads((ddp_run / "run_config.json").read_text())
    assert resolved["world_size"] == 2 and resolved["distributed_type"] == "MULTI_CPU"
    assert resolved["effective_batch_size"] == 32 and resolved["mixed_precision"] == "no"
    assert resolved["config"]["max_train_samples"] == 64 and "torch" in resolved["versions"]
    steps = read_jsonl(ddp_run / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 17))
    assert all(s["samples"] == 32 for s in steps) and all(s["tokens"] > 0 for s in steps)
    assert list((ddp_run / "cls").glob("events.out.tfevents.*")), "no TensorBoard event file"


@pytest.mark.multiproc
def test_final_model_reloads_and_reproduces_accuracy(ddp_run):
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    final = ddp_run / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    cfg = cls.parse_config(["--model_name_or_path", str(final), "--max_train_samples", "64",
                            "--max_eval_samples", str(N_EVAL)])
    accelerator = Accelerator(cpu=True)
    eval_dl, names = eval_loader(cfg, tokenizer)
    assert model.config.id2label == dict(enumerate(names)) == {0: "negative", 1: "positive"}
    result = cls.evaluate(model, eval_dl, accelerator, load_metrics())
    reported = read_jsonl(ddp_run / "eval.jsonl")[-1]
    assert result["n_examples"] == N_EVAL
    assert result["accuracy"] == reported["accuracy"]
    assert result["f1_macro"] == pytest.approx(reported["f1_macro"], abs=1e-12)


@no_gpu
def test_data_parallel_falls_back_to_one_device_on_cpu(tiny_model, tmp_path):
    proc = run_recipe(tmp_path, "--data_parallel", "--max_train_steps", "3", config=None)
    assert "falling back to one device" in proc.stdout
    assert read_jsonl(tmp_path / "eval.jsonl")[-1]["n_examples"] == N_EVAL
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert not (tmp_path / "ranks").exists()  # the test probe is inert without --record_ranks


def test_string_labels_from_csv_are_mapped_and_saved(tiny_model, tmp_path):
    rows = [("好 书", "pos"), ("很差", "neg"), ("一般", "meh")] * 20
    train = tmp_path / "train.csv"
    train.write_text("review,sentiment\n" + "".join(f"{t},{l}\n" for t, l in rows))
    out = tmp_path / "run"
    run_recipe(out, "--train_file", str(train), "--validation_file", str(train), "--text_column", "review",
               "--label_column", "sentiment", "--max_train_steps", "2", config=None)
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved["id2label"] == {"0": "meh", "1": "neg", "2": "pos"}
    assert read_jsonl(out / "eval.jsonl")[-1]["n_examples"] == 60


def _write(path, text):
    path.write_text(text)
    return str(path)


BAD_INPUTS = {
    "missing file": (lambda d: ["--train_file", str(d / "nope.csv")], "data file not found"),
    "missing text column": (lambda d: ["--train_file", _write(d / "a.csv", "body,label\nx,1\ny,0\n"),
                                       "--validation_split", "0.5"], "has no column 'text'"),
    "missing label column": (lambda d: ["--train_file", _write(d / "b.jsonl", '{"text": "x"}\n{"text": "y"}\n'),
                                        "--validation_split", "0.5"], "has no column 'label'"),
    "empty after filtering": (lambda d: ["--train_file", _write(d / "c.jsonl", '{"text": " ", "label": 1}\n' * 4),
                                         "--validation_split", "0.5"], "empty after dropping empty texts"),
    # Float labels are a regression now (issue 10); a label that is no int, string, float or list still fails.
    "dict label": (lambda d: ["--train_file", _write(d / "d.jsonl", '{"text": "x", "label": {"a": 1}}\n' * 4),
                              "--validation_split", "0.5"], "labels must be ints or strings"),
    "unknown flag": (lambda d: ["--learning_rat", "1e-3"], "unknown arguments: --learning_rat"),
    "both sources": (lambda d: ["--dataset_name", "x", "--train_file", "y.csv"], "not both"),
}


def test_bad_input_fails_with_one_clear_line(tiny_model, tmp_path):
    """The command line: exit status 2 and one `error: ` line (the other cases run in-process, below)."""
    make_flags, message = BAD_INPUTS["unknown flag"]
    out = tmp_path / "run"
    proc = run_recipe(out, *make_flags(tmp_path), config=None, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    assert not (out / "final").exists() and not (out / "final.tmp").exists()


@pytest.mark.parametrize("case", [c for c in BAD_INPUTS if c != "unknown flag"])
def test_bad_input_raises_recipe_error_before_writing(tiny_model, tmp_path, case):
    """In-process, the recipe's own main(): the RecipeError that __main__ prints as the one line, and no final/."""
    from helpers import TINY_FLAGS

    make_flags, message = BAD_INPUTS[case]
    out = tmp_path / "run"
    with pytest.raises(RecipeError, match=message) as caught:
        cls.main(cls.parse_config([*TINY_FLAGS, "--output_dir", str(out), *make_flags(tmp_path)]))
    assert "\n" not in str(caught.value)
    assert not (out / "final").exists() and not (out / "final.tmp").exists()


def test_missing_launch_config_is_refused(tmp_path):
    proc = run_recipe(tmp_path, config="no_such_strategy.yaml", check=False)
    assert proc.returncode != 0
    assert "no_such_strategy.yaml" in proc.stderr and not (tmp_path / "final").exists()


# Samples per round, counted by hand: full rounds of batch x world, then the remainder as one round, or folded
# into the last round when smaller than the world size (33 = 32 + 1, 65 = 64 + 1).
@pytest.mark.parametrize("n,batch,world,rounds", [(256, 16, 2, [32] * 8), (101, 16, 2, [32, 32, 32, 5]),
                                                  (33, 16, 2, [33]), (3, 16, 2, [3]), (65, 32, 2, [65]),
                                                  (17, 4, 3, [12, 5]), (1, 8, 1, [1])])
def test_even_shard_sampler_deals_every_sample_once_and_evenly(n, batch, world, rounds):
    sampler = data.EvenShardBatchSampler(n, batch, world, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) and len(batches) % world == 0
    per_rank = [batches[r::world] for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # same number of micro-batches on every rank
    assert sorted(i for b in batches for i in b) == list(range(n))
    assert all(len(b) > 0 for b in batches)
    assert [sum(len(b) for b in batches[k * world:(k + 1) * world]) for k in range(len(batches) // world)] == rounds
    sampler.set_epoch(1)
    assert list(sampler) != batches or n == 1  # a new epoch reshuffles


def test_shipped_metrics_match_hand_computed_values():
    metrics = load_metrics(extra=("f1", "matthews_correlation"))
    preds, refs = [0, 1, 1, 0, 2], [0, 1, 0, 0, 2]
    # class 0: tp 2 fp 0 fn 1 -> 0.8; class 1 (the positive class of `f1`): tp 1 fp 1 fn 0 -> 2/3; class 2: 1.0
    # Matthews: c = 4 correct of s = 5; true counts t = (3, 1, 1), predicted p = (2, 2, 1):
    # (4 * 5 - (6 + 2 + 1)) / sqrt((25 - 9) * (25 - 11)) = 11 / sqrt(224)
    assert compute_metrics(metrics, torch.tensor(preds), torch.tensor(refs)) == pytest.approx(
        {"accuracy": 0.8, "f1_macro": (0.8 + 2 / 3 + 1.0) / 3, "f1": 2 / 3, "matthews_correlation": 11 / 224 ** 0.5})
    # two classes: Matthews is (tp tn - fp fn) / sqrt((tp + fp)(tp + fn)(tn + fp)(tn + fn)); tp 2 tn 1 fp 1 fn 1
    two = compute_metrics(metrics, torch.tensor([1, 1, 0, 1, 0]), torch.tensor([1, 1, 0, 0, 1]))
    assert two["matthews_correlation"] == pytest.approx((2 * 1 - 1 * 1) / (3 * 3 * 2 * 2) ** 0.5)
    assert two["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert compute_metrics(metrics, torch.tensor([1, 1]), torch.tensor([1, 1]))["matthews_correlation"] == 0.0
    # predicted and true class counts that differ: t = (2, 3, 1), p = (3, 1, 2), 3 of 6 correct: (18 - 11) / 22
    three = compute_metrics(metrics, torch.tensor([0, 0, 0, 1, 2, 2]), torch.tensor([0, 1, 1, 1, 2, 0]))
    assert three["matthews_correlation"] == pytest.approx(7 / 22)
    # tp 1 fp 2 tn 1 fn 1: (1 * 1 - 2 * 1) / sqrt(3 * 2 * 3 * 2)
    two = compute_metrics(metrics, torch.tensor([1, 1, 1, 0, 0]), torch.tensor([1, 0, 0, 0, 1]))
    assert two["matthews_correlation"] == pytest.approx(-1 / 6) and two["f1"] == pytest.approx(2 / 5)


def test_kept_rows_read_what_the_limit_needs_and_only_file_data_is_cached(tiny_model, tmp_path):
    """data.kept_rows gives the first `limit` non-empty rows (every row with keep_empty), as a filter of the whole
    column would, whatever the slices it reads; tokenize_split tokenizes a dataset held in memory without a cache
    file, and one read from a file under datasets' own fingerprint, so that the same run again reads its cache."""
    from datasets import Dataset, load_dataset
    from transformers import AutoTokenizer

    texts = ["好 书", "", " ", None, "很差"] * 900  # 4,500 rows: 1,800 with text, spread over several slices
    ds = Dataset.from_dict({"text": texts, "label": [1, 0, 0, 0, 0] * 900})
    kept = [i for i, text in enumerate(texts) if text and text.strip()]
    for limit in (None, 0, 1, 7, 600, 1799, 1800, 5000):
        assert data.kept_rows(ds, "text", limit) == (kept if limit is None else kept[:limit]), limit
        every = range(4500) if limit is None else range(min(limit, 4500))
        assert data.kept_rows(ds, "text", limit, keep_empty=True) == list(every), limit
    csv = tmp_path / "train.csv"
    ds.to_csv(csv, index=False)
    from_file = load_dataset("csv", data_files=str(csv), split="train", cache_dir=str(tmp_path / "cache"))
    cfg = cls.parse_config(["--model_name_or_path", str(tiny_model), "--output_dir", str(tmp_path / "out")])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    _, encode = data.label_space(ds, ds, cfg)
    in_memory = data.tokenize_split(ds, cfg, tokenizer, encode, "training", 700)
    first, again = (data.tokenize_split(from_file, cfg, tokenizer, encode, "training", 700) for _ in range(2))
    assert in_memory.cache_files == [] and len(in_memory) == 700
    assert first.cache_files and again.cache_files == first.cache_files  # the second map read the first's file
    assert in_memory["input_ids"][:] == first["input_ids"][:] and in_memory[data.ROW][:] == kept[:700]
