"""ONNX export (recipes/export.py) per task type, and what the exported folder predicts.

One tiny run per task type (tests/serving_data.py: single-label with a folded temperature, pairs, regression,
multi-label with per-label thresholds, a merged LoRA run), 2 optimizer steps each, exported once. Each export holds its
parity check on the run's validation data (every logit within 1e-4 of PyTorch's, the same decisions but near-ties), an
ONNX Runtime session opened here gives PyTorch's logits again at other batch sizes and lengths, and the folder carries
labels, problem type, thresholds and tokenizer. recipes/predict.py on final/ and on the export gives the labels of
`pipeline("text-classification", truncation=True)` (multi-label at the run's thresholds). A graph that is not the
model's is refused with nothing left; bad folders and flags are one line each.
"""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

import serving_data
from helpers import REPO, committed_results, python, read_jsonl
from recipes import RecipeError, export, predict
from recipes.inputs import problem
from recipes.serving import classifier, onnx_export, parity



@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_model):
    """kind -> (run folder, data files, export record): trained and exported on first use, once per module."""
    root, cache = tmp_path_factory.mktemp("serving"), {}

    def get(kind):
        if kind not in cache:
            out, files = serving_data.train(kind, root)
            flags = ["--int8"] if kind == "single" else []
            cache[kind] = out, files, export.main(export.parse_config(["--run_dir", str(out), *flags]), say=print)
        return cache[kind]
    return get


def torch_and_onnx_logits(folder, onnx_folder, rows, kind):
    """PyTorch's logits (fp32) and a fresh ONNX Runtime session's, for `rows` batched as given (one padded batch)."""
    import onnxruntime as ort
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(onnx_folder)
    pairs = [r["text_pair"] for r in rows] if kind == "pairs" else None
    batch = tokenizer([r["text"] for r in rows], pairs, truncation=True, padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = model(**batch).logits
    session = ort.InferenceSession(str(onnx_folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feed = {i.name: batch[i.name].numpy() for i in session.get_inputs()}
    return reference, torch.from_numpy(session.run(None, feed)[0])


@pytest.mark.parametrize("kind", list(serving_data.KINDS))
def test_export_holds_parity_and_carries_what_serving_needs(made, kind):
    out, files, record = made(kind)
    checked = record["parity"]
    print(f"{kind}: max |logit difference| {checked['max_abs_logit_difference']:.2e} on {checked['examples']} rows, "
          f"{checked['near_ties']} near-ties; shapes {checked['shapes']}")
    assert checked["examples"] == 40  # the run's --max_eval_samples of its validation file
    assert checked["max_abs_logit_difference"] <= 1e-4 and checked["decisions_differing"] == 0
    assert set(checked["shapes"]) == {"one row", "2 rows of 512 tokens"}
    assert all(s["max_abs_logit_difference"] <= 1e-4 for s in checked["shapes"].values())
    evaluation = read_jsonl(out / "eval.jsonl")[-1]  # final/'s evaluation: the same rows scored alike
    main_score = {"single": "accuracy", "pairs": "accuracy", "lora": "accuracy", "regression": "pearson"}.get(kind)
    if main_score:  # (multi-label: the run evaluates at 0.5, the export at the stored thresholds)
        assert checked["scores"]["pytorch"][main_score] == pytest.approx(evaluation[main_score], abs=1e-5)
        assert checked["scores"]["onnx"][main_score] == pytest.approx(evaluation[main_score], abs=1e-4)

    onnx_folder, final = out / "onnx", out / "final"
    saved, exported = (json.loads((f / "config.json").read_text()) for f in (final, onnx_folder))
    assert exported == saved and record["labels"] == list(saved["id2label"].values())
    assert record["problem_type"] == {"pairs": "single_label", "lora": "single_label", "single": "single_label"}.get(
        kind, kind) and saved["problem_type"] == problem.HF_PROBLEM_TYPE[record["problem_type"]]
    if kind == "multi_label":  # the run's thresholds go with the file, and the check used them
        assert record["thresholds"] == pytest.approx(saved["label_thresholds"]) and saved["label_thresholds"]
    if kind == "single":  # the temperature is folded into the weights the graph was traced from
        assert saved["calibration_temperature"] != pytest.approx(1.0) and record["calibration_temperature"]
    if kind == "lora":
        assert (final / "adapter").is_dir()  # final/ is the merged model beside its adapter
    rows = read_jsonl(files["validation"])
    for batch in (rows[:1], rows[:7], rows[10:13]):  # other batch sizes and lengths than the check's
        reference, got = torch_and_onnx_logits(final, onnx_folder, batch, kind)
        assert got.shape == reference.shape and (got - reference).abs().max() <= 1e-4


def margin_rows(kind, record, threshold) -> set:
    """Rows of a prediction whose decision is a near-tie (within parity.TIE_MARGIN of flipping)."""
    probs = torch.tensor([list(r["probabilities"].values()) for r in record])
    logits = probs.log() if kind != "multi_label" else (probs / (1 - probs)).log()
    return {i for i, m in enumerate(parity.margins("multi_label" if kind == "multi_label" else "single_label", logits,
                                                   threshold)) if m <= parity.TIE_MARGIN}


@pytest.mark.parametrize("kind", ["single", "pairs", "regression", "multi_label"])
def test_predictions_equal_the_pipeline_from_final_and_from_onnx(made, kind, tmp_path):
    from transformers import pipeline

    out, files, record = made(kind)
    rows = read_jsonl(files["predict"])
    served = {}
    for name, folder in (("pytorch", out), ("onnx", out / "onnx")):
        predict.main(predict.parse_config(["--model_dir", str(folder), "--predict_file", files["predict"],
                                           "--output_dir", str(tmp_path / name), "--window_rows", "50",
                                           "--batch_size", "8", "--threads", "1"]))
        served[name] = read_jsonl(tmp_path / name / "predictions.jsonl")
        assert [r["row"] for r in served[name]] == list(range(len(rows)))
        assert [("label" in r) for r in served[name]] == [row["label"] is not None for row in rows]
    pipe = pipeline("text-classification", model=str(out / "final"), device=-1)
    inputs = [{"text": r["text"], "text_pair": r["text_pair"]} if kind == "pairs" else r["text"] for r in rows]
    expected = pipe(inputs, truncation=True, top_k=None, batch_size=8)
    thresholds = record["thresholds"] and torch.tensor(list(record["thresholds"].values()))
    for name, lines in served.items():
        if kind == "regression":
            got = torch.tensor([r["prediction"] for r in lines])
            assert (got - torch.tensor([e[0]["score"] for e in expected])).abs().max() <= 1e-4, name
            continue
        ties = margin_rows(kind, lines, thresholds)
        if kind == "multi_label":  # the pipeline's sigmoid scores at the run's own thresholds
            by_name = [{s["label"]: s["score"] for s in e} for e in expected]
            wanted = [sorted(n for n, t in record["thresholds"].items() if s[n] >= t) for s in by_name]
            got = [sorted(r["prediction"]) for r in lines]
        else:
            wanted = [max(e, key=lambda s: s["score"])["label"] for e in expected]
            got = [r["prediction"] for r in lines]
        differ = [i for i, (a, b) in enumerate(zip(got, wanted)) if a != b]
        print(f"{kind} {name}: {len(ties)} near-ties, labels differing from the pipeline's at rows {differ}")
        assert set(differ) <= ties, (name, differ)
        # most rows are compared: 2 training steps leave many multi-label rows at the thresholds fitted on them
        assert len(ties) <= len(lines) // (3 if kind == "multi_label" else 10)
    for a, b in zip(served["pytorch"], served["onnx"]):  # the two runtimes agree row by row
        if kind == "regression":
            assert a["prediction"] == pytest.approx(b["prediction"], abs=1e-4)
        else:
            assert a["probabilities"] == pytest.approx(b["probabilities"], abs=1e-4)


def test_int8_is_scored_and_timed_beside_fp32_and_predicts(made, tmp_path):
    out, files, record = made("single")
    report = record["int8"]
    assert (out / "onnx" / "model.int8.onnx").stat().st_size < 0.5 * (out / "onnx" / "model.onnx").stat().st_size
    assert set(report["scores"]) == {"fp32", "int8"} and report["score"] == "accuracy"
    assert report["drop_points"] == pytest.approx(
        100 * (report["scores"]["fp32"]["accuracy"] - report["scores"]["int8"]["accuracy"]))
    assert report["scores"]["fp32"] == record["parity"]["scores"]["onnx"]
    assert all(len(v) == 3 and min(v) > 0 for v in report["rows_per_s_rounds"].values())
    predict.main(predict.parse_config(["--model_dir", str(out / "onnx"), "--onnx_file", "model.int8.onnx",
                                       "--predict_file", files["validation"], "--output_dir", str(tmp_path),
                                       "--threads", "1"]))
    lines = read_jsonl(tmp_path / "predictions.jsonl")
    assert json.loads((tmp_path / "predict_run.json").read_text())["binding"]["model"].endswith("model.int8.onnx")
    assert [r["row"] for r in lines] == list(range(80))
    # int8 quantizes each batch's activations with its own scale: decisions near a tie may move, few others
    assert report["against_fp32"]["max_abs_logit_difference"] < 0.5
    assert report["against_fp32"]["decisions_differing"] <= 4


def test_a_graph_that_is_not_the_model_is_refused_and_nothing_is_left(made, monkeypatch, tmp_path):
    """The exporter stands in for one that traced another model (the LoRA run's): the parity check refuses it."""
    from transformers import AutoModelForSequenceClassification

    out, _, _ = made("single")
    other = AutoModelForSequenceClassification.from_pretrained(made("lora")[0] / "final").eval()
    real = onnx_export.export
    monkeypatch.setattr(onnx_export, "export", lambda model, sample, path: real(other, sample, path))
    target = tmp_path / "export"
    with pytest.raises(RecipeError, match=r"the ONNX graph does not reproduce the model on 40 rows of the run's "
                                          r"validation data .*: max \|logit difference\| .*; nothing exported"):
        export.main(export.parse_config(["--run_dir", str(out), "--output_dir", str(target)]), say=print)
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_bad_folders_and_flags_are_one_line_each(made, tmp_path):
    out, files, _ = made("regression")
    lone = tmp_path / "lone"  # a weights folder with no run beside it
    shutil.copytree(out / "final", lone)
    moved = tmp_path / "moved"  # a run whose validation file is gone
    shutil.copytree(out, moved)
    record = json.loads((moved / "run_config.json").read_text())
    record["config"]["validation_file"] = str(tmp_path / "gone.jsonl")
    (moved / "run_config.json").write_text(json.dumps(record))
    cases = [
        (["--run_dir", str(out)], f"{out / 'onnx'} holds an earlier export: --overwrite_output_dir replaces it"),
        (["--run_dir", str(out / "onnx"), "--output_dir", str(tmp_path / "x")], "is an export folder (ONNX, no "
                                                                               "PyTorch weights)"),
        (["--run_dir", str(tmp_path)], "holds no classifier (no config.json, nor final/config.json)"),
        (["--run_dir", str(REPO / "artifacts" / "minilm"), "--output_dir", str(tmp_path / "x")],
         "is not a sequence classifier (architectures: BertModel)"),
        (["--run_dir", str(lone), "--output_dir", str(tmp_path / "x")], "run_config.json to find the run's "
                                                                        "validation data: give --validation_file"),
        (["--run_dir", str(lone)], "no run folder around"),
        (["--run_dir", str(moved), "--output_dir", str(tmp_path / "x")], "data file not found: "
                                                                          f"{tmp_path / 'gone.jsonl'}; give "
                                                                          "--validation_file"),
        (["--run_dir", str(out), "--validation_file", files["validation"], "--text_column", "txt", "--output_dir",
          str(tmp_path / "x")], "validation data has no column 'txt'"),
        (["--run_dir", str(out), "--int9"], "unknown arguments: --int9"),
    ]
    for argv, message in cases:
        with pytest.raises(RecipeError) as err:
            export.main(export.parse_config(argv), say=print)
        assert message in str(err.value) and "\n" not in str(err.value), (argv, str(err.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lone", "moved"]
    # as a command: exit status 2, one error line, nothing written
    proc = subprocess.run([python(), "recipes/export.py", "--run_dir", str(lone), "--output_dir", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: no ")
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == \
        [proc.stderr.strip().splitlines()[-1]] and not (tmp_path / "x").exists()


def test_an_export_folder_without_a_run_is_checked_on_a_given_file(made, tmp_path):
    """A weights folder alone (no run_config.json): checked on --validation_file, exported where --output_dir says,
    and its export.json carries the text settings prediction needs."""
    out, files, _ = made("pairs")
    lone = tmp_path / "lone"
    shutil.copytree(out / "final", lone)
    record = export.main(export.parse_config(["--run_dir", str(lone), "--validation_file", files["validation"],
                                              "--text_pair_column", "text_pair", "--output_dir",
                                              str(tmp_path / "x")]), say=print)
    assert record["parity"]["examples"] == 40 and record["run"] is None  # every row of the file
    assert record["text_settings"]["text_pair_column"] == "text_pair"
    found = classifier.locate(str(tmp_path / "x"))
    assert found.onnx_file == tmp_path / "x" / "model.onnx" and found.names == sorted(serving_data.PAIR_NAMES)


def test_export_page_quotes_the_latest_predict_results():
    """docs/export.md gives the latest `make bench BENCH=predict` figures as scripts/measure/bench_predict.py prints them for
    the page, and links that results file."""
    from scripts.measure import bench_predict

    path = max(committed_results("*_predict_*.json"), key=lambda p: (json.loads(p.read_text())["date"], p.name))
    result = json.loads(path.read_text())
    page = (REPO / "docs" / "export.md").read_text()
    assert f"](../results/{path.stem}.md)" in page
    for line in bench_predict.page_lines(result):
        assert line in page, line
    parity_figure = f"{result['export_parity']['max_abs_logit_difference']:.1e}"
    assert parity_figure in page and f"{result['export_parity']['examples']:,}" in page
