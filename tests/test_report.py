"""The evaluation report (recipes/outputs/report.py): scores against hand-computed values, in-process; launched, the
report of a DDP run counts every validation example once and describes the evaluation final/ holds.
"""
from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from helpers import read_jsonl, run_recipe
from recipes import RecipeError
from recipes.inputs import problem
from recipes.outputs import calibration, report


def test_single_label_scores_confusion_and_calibration_by_hand():
    # 6 examples, 3 classes; top probabilities 0.9, 0.9, 0.6, 0.6, 0.4, 0.95
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.6, 0.3, 0.1], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4],
                          [0.025, 0.025, 0.95]])
    labels = torch.tensor([0, 1, 1, 1, 0, 2])
    r = report.single_label(probs.log(), labels, ["a", "b", "c"])  # log-probabilities: softmax gives probs back
    assert r["confusion_matrix"]["true_by_predicted"] == [[1, 0, 1], [1, 2, 0], [0, 0, 1]]
    assert r["accuracy"] == pytest.approx(4 / 6)
    assert r["per_class"]["a"] == pytest.approx({"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2})
    assert r["per_class"]["b"] == pytest.approx({"precision": 1.0, "recall": 2 / 3, "f1": 0.8, "support": 3})
    assert r["per_class"]["c"] == pytest.approx({"precision": 0.5, "recall": 1.0, "f1": 2 / 3, "support": 1})
    assert r["macro"]["f1"] == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
    # bins of 1/15: 0.4 -> (0.3333, 0.4] ; 0.6 x 2 -> (0.5333, 0.6] ; 0.9 x 2 -> (0.8667, 0.9]; 0.95 -> (0.9333, 1]
    # accuracy per bin: 0 (0.4 wrong), 1/2 (0.6: right for row 3, wrong for row 2), 1, 1
    ece = (1 * abs(0 - 0.4) + 2 * abs(0.5 - 0.6) + 2 * abs(1 - 0.9) + 1 * abs(1 - 0.95)) / 6
    cal = r["calibration"]
    assert cal["ece"] == pytest.approx(ece, abs=1e-6)
    assert [b["count"] for b in cal["per_bin"] if b["count"]] == [1, 2, 2, 1] and sum(
        b["count"] for b in cal["per_bin"]) == 6


def test_multi_label_thresholds_and_regression_by_hand():
    probs = torch.tensor([[0.9, 0.2], [0.7, 0.6], [0.4, 0.1], [0.3, 0.8]])
    labels = torch.tensor([[1, 0], [1, 1], [1, 0], [0, 0]])
    r = report.multi_label(torch.logit(probs), labels, ["x", "y"], threshold=0.5)
    x, y = r["per_label"]["x"], r["per_label"]["y"]
    assert x["confusion_tn_fp_fn_tp"] == [1, 0, 1, 2] and x["recall"] == pytest.approx(2 / 3)
    assert x["best_f1_threshold"] == pytest.approx({"threshold": 0.4, "f1": 1.0})
    assert y["confusion_tn_fp_fn_tp"] == [2, 1, 0, 1] and y["best_f1_threshold"]["threshold"] == pytest.approx(0.6)
    reg = report.regression(torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([1.0, 3.0, 3.0]))
    assert reg["mae"] == pytest.approx(2 / 3) and reg["rmse"] == pytest.approx((2 / 3) ** 0.5)
    assert reg["r2"] == pytest.approx(1 - 2 / (8 / 3)) and reg["residual_mean"] == pytest.approx(0.0)


def test_held_outputs_and_a_report_without_matplotlib(tmp_path, monkeypatch):
    kept = report.Kept()
    first, second = {"step": 4}, {"step": 8}
    kept.record(first, True)
    kept.record(second, False)
    assert kept.held(False) == (second, "last evaluation") and kept.held(True)[0] is first
    assert report.Kept().held(True)[0] is None
    late = report.Kept()
    late.record(second, False)  # resumed after the best evaluation: the report says which it describes
    assert late.held(True)[0] is second and "before this run resumed" in late.held(True)[1]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the report extra not installed
    said = []
    cfg = types.SimpleNamespace(problem_type="regression", multi_label_threshold=0.5)
    outputs = {"step": 3, "logits": torch.tensor([[1.0], [2.0]]), "references": torch.tensor([1.0, 2.5])}
    written = report.write(cfg, tmp_path, outputs, "last evaluation", ["score"], say=said.append)
    folder = tmp_path / report.FOLDER
    assert sorted(p.name for p in folder.iterdir()) == ["report.json"] and len(said) == 1 and "matplotlib" in said[0]
    assert json.loads((folder / "report.json").read_text())["mae"] == pytest.approx(0.25) == written["mae"]
    assert report.write(cfg, tmp_path / "none", None, "last evaluation", ["score"]) is None


def test_ddp_report_counts_every_example_once_and_describes_final(tiny_model, tmp_path):
    out = tmp_path / "run"
    run_recipe(out, "--eval_report", "true", "--eval_steps", "4", "--load_best_model_at_end", "--calibrate",
               "temperature")
    r = json.loads((out / "eval_report" / "report.json").read_text())
    best = json.loads((out / "best" / "best_model.json").read_text())
    evals = read_jsonl(out / "eval.jsonl")
    assert len(evals) >= 2 and r["evaluation"].startswith("best") and r["step"] == best["step"]
    held = next(e for e in evals if e["step"] == best["step"])
    assert r["n_examples"] == held["n_examples"] == 101
    assert sum(map(sum, r["confusion_matrix"]["true_by_predicted"])) == 101
    assert r["accuracy"] == pytest.approx(held["accuracy"]) and r["macro"]["f1"] == pytest.approx(held["f1_macro"])
    assert sum(b["count"] for b in r["calibration"]["per_bin"]) == 101
    assert {p.name for p in (out / "eval_report").iterdir()} == {"report.json", "confusion_matrix.png",
                                                                 "reliability.png", "calibration.json"}
    assert "## Evaluation report (eval_report/, best evaluation" in (out / "final" / "README.md").read_text()
    # the temperature, fitted on the best evaluation's logits, is folded into final/ (a copy of best/): final/'s
    # logits are best/'s over T, the argmax and so the report's confusion matrix unchanged
    fitted = json.loads((out / "eval_report" / "calibration.json").read_text())
    assert fitted["step"] == best["step"] and fitted["fit_examples"] + fitted["held_out_examples"] == 101
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "final")
    batch = tok(["很好用，推荐", "质量太差了，不会再买", "一般般"], padding=True, return_tensors="pt")
    with torch.no_grad():
        raw = AutoModelForSequenceClassification.from_pretrained(out / "best")(**batch).logits
        folded = AutoModelForSequenceClassification.from_pretrained(out / "final")(**batch).logits
    assert (folded - raw / fitted["temperature"]).abs().max().item() < 1e-5
    assert "Calibrated (--calibrate temperature)" in (out / "final" / "README.md").read_text()
    # --do_train false on final/, one process: the same argmax, hence the same confusion matrix and counts
    again = tmp_path / "again"
    run_recipe(again, "--do_train", "false", "--eval_report", "true", "--model_name_or_path", str(out / "final"),
               config=None)
    r2 = json.loads((again / "eval_report" / "report.json").read_text())
    assert r2["confusion_matrix"] == r["confusion_matrix"] and r2["n_examples"] == 101


def test_fitted_temperature_recovers_the_generating_one_and_folds_exactly(tmp_path):
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(20000, 4, generator=gen)
    labels = torch.multinomial((logits / 2.5).softmax(dim=-1), 1, generator=gen).squeeze(-1)  # the truth: T = 2.5
    fitted = calibration.fit_temperature(logits, labels)
    assert abs(fitted - 2.5) < 0.1
    assert calibration.nll(logits, labels, fitted) < calibration.nll(logits, labels, 1.0)
    from transformers import AutoConfig, AutoModelForSequenceClassification

    x = torch.randint(3, 100, (2, 7))
    for arch in ("roberta", "bert"):  # a two-layer head (out_proj) and a one-layer one
        config = AutoConfig.for_model(arch, vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64, num_labels=3)
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(config).eval()
        model.save_pretrained(tmp_path / arch)
        layer = calibration.fold(tmp_path / arch, 2.0)
        assert layer == {"roberta": "classifier.out_proj", "bert": "classifier"}[arch]
        folded = AutoModelForSequenceClassification.from_pretrained(tmp_path / arch).eval()
        with torch.no_grad():
            assert (folded(x).logits - model(x).logits / 2).abs().max().item() < 1e-6
        assert folded.config.calibration_temperature == 2.0


@pytest.mark.parametrize("flags, message", [
    (dict(calibrate="platt"), "unknown --calibrate 'platt'"),
    (dict(problem_type="multi_label"), "single-label classification, not multi_label"),
    (dict(do_train=False), "needs training and an evaluation"),
])
def test_calibrations_it_cannot_make_are_one_line_errors(flags, message):
    cfg = types.SimpleNamespace(**{"calibrate": "temperature", "problem_type": "single_label", "do_train": True,
                                   "do_eval": True, **flags})
    with pytest.raises(RecipeError, match=message):
        calibration.check(cfg)


def test_multi_label_thresholds_are_stored_in_final_and_used_by_predictions(tmp_path):
    from transformers import AutoConfig

    probs = torch.tensor([[0.9, 0.2], [0.7, 0.6], [0.4, 0.1], [0.3, 0.8]])
    outputs = {"step": 5, "logits": torch.logit(probs), "references": torch.tensor([[1, 0], [1, 1], [1, 0], [0, 0]])}
    cfg = types.SimpleNamespace(problem_type="multi_label", calibrate="thresholds", multi_label_threshold=0.5)
    config = AutoConfig.for_model("roberta", num_labels=2, id2label={0: "x", 1: "y"}, label2id={"x": 0, "y": 1})
    fitted = calibration.label_thresholds(cfg, outputs, "last evaluation", ["x", "y"], config)
    assert fitted.tolist() == pytest.approx([0.4, 0.6])  # each label's best F1 (test_multi_label_thresholds_...)
    config.save_pretrained(tmp_path / "final")
    fitted_record = calibration.calibrate(cfg, tmp_path, outputs, "last evaluation", ["x", "y"], fitted,
                                          say=lambda line: None)
    stored = AutoConfig.from_pretrained(tmp_path / "final")
    assert stored.label_thresholds == pytest.approx({"x": 0.4, "y": 0.6})
    later = types.SimpleNamespace(problem_type="multi_label", calibrate=None, multi_label_threshold=0.5)
    again = calibration.label_thresholds(later, None, "", ["x", "y"], stored)  # a later run on that final/
    assert again.tolist() == pytest.approx([0.4, 0.6])
    assert calibration.label_thresholds(later, None, "", ["x", "y"], config) is None  # nothing stored: the flag's
    record = problem.prediction_record("multi_label", 7, torch.logit(torch.tensor([0.45, 0.55])), ["x", "y"], again)
    assert record["prediction"] == ["x"]  # 0.45 >= 0.4, 0.55 < 0.6; at 0.5 it would have been ["y"]
    written = report.write(cfg, tmp_path, outputs, "last evaluation", ["x", "y"], say=lambda line: None)
    assert "as `label_thresholds`" in "\n".join(report.card_lines(written, fitted_record))  # the model card says so
