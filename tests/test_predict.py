"""Batch prediction (recipes/predict.py): every row once and in input order on 2 processes, a SIGKILLed prediction
continued by the same command, and the refusals (each one line, nothing half-written left looking complete).

The model is one tiny single-label run (tests/serving_data.py); the rows are its predict file repeated, windows and
batches small so that a file spans many windows.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

import serving_data
from helpers import PYTHON, REPO, free_port, kill_group, launcher, read_jsonl
from recipes import RecipeError, predict
from recipes.serving import output

# 20 windows of 24 rows, 6 batches each; one thread per process (the launches' share of a 2-core machine)
SMALL = ["--window_rows", "24", "--batch_size", "4", "--threads", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model):
    """(the run folder, its data files, a predict file of 480 rows: the predict rows 3 times)."""
    root = tmp_path_factory.mktemp("predict")
    out, files = serving_data.train("single", root)
    rows = read_jsonl(files["predict"]) * 3
    files["many"] = serving_data.write_jsonl(root / "many.jsonl", rows)
    return out, files


def command(out, rows, target, *flags) -> list[str]:
    return [PYTHON, "recipes/predict.py", "--model_dir", str(out), "--predict_file", rows, "--output_dir",
            str(target), *flags]


def probabilities(path):
    return [r["probabilities"]["positive"] for r in read_jsonl(path / "predictions.jsonl")]


@pytest.mark.multiproc
def test_two_processes_write_every_row_once_in_input_order(run, tmp_path):
    out, files = run
    predict.main(predict.parse_config(command(out, files["many"], tmp_path / "one", *SMALL)[2:]))
    launch = [*launcher(), "launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
              "--main_process_port", str(free_port()), *command(out, files["many"], tmp_path / "two", *SMALL)[1:]]
    proc = subprocess.run(launch, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_jsonl(tmp_path / "two" / "predictions.jsonl")
    assert [r["row"] for r in lines] == list(range(480))  # each window's 6 batches dealt to 2 processes
    record = json.loads((tmp_path / "two" / "predict_run.json").read_text())
    assert record["complete"] and record["world_size"] == 2 and record["rows"] == 480
    assert proc.stdout.count("predicted 480 rows") == 1  # the main process writes and reports, once
    # the same batches as one process computes
    assert probabilities(tmp_path / "two") == pytest.approx(probabilities(tmp_path / "one"), abs=1e-6)
    assert [r["prediction"] for r in lines] == [r["prediction"] for r in read_jsonl(tmp_path / "one" /
                                                                                     "predictions.jsonl")]


def test_a_killed_prediction_is_continued_by_the_same_command(run, tmp_path):
    out, files = run
    target = tmp_path / "killed"
    cmd = command(out, files["many"], target, *SMALL)
    partial = target / output.PARTIAL
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True) as proc:
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            if partial.exists() and partial.stat().st_size > 0:
                os.killpg(proc.pid, signal.SIGKILL)  # mid-file: the first window is written, 19 are not
                break
            time.sleep(0.005)
        kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not (target / output.FINAL).exists() and partial.exists()  # marked partial by its name and its record
    written = len(partial.read_bytes().splitlines())
    assert 0 < written < 480 and json.loads((target / output.RECORD).read_text())["complete"] is False
    finished = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "(rows 0-" in finished.stdout and not partial.exists()
    lines = read_jsonl(target / output.FINAL)
    assert [r["row"] for r in lines] == list(range(480))  # every row exactly once, in input order
    predict.main(predict.parse_config(command(out, files["many"], tmp_path / "whole", *SMALL)[2:]))
    assert probabilities(target) == pytest.approx(probabilities(tmp_path / "whole"), abs=1e-6)
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1] == (
        f"error: {target / output.FINAL} holds a finished prediction: --overwrite_output_dir replaces it")


def test_a_line_cut_by_the_kill_is_dropped_and_predicted_again(tmp_path):
    lines = [json.dumps({"row": i, "prediction": "x"}) + "\n" for i in range(3)]
    partial = tmp_path / output.PARTIAL
    partial.write_text("".join(lines) + '{"row": 3, "predi')
    assert output.whole_lines(partial) == 3 and partial.read_text() == "".join(lines)
    partial.write_text("".join(lines[:2]) + lines[0])  # a line out of order: what follows is not trusted
    assert output.whole_lines(partial) == 2 and partial.read_text() == "".join(lines[:2])


def test_a_hub_dataset_split_is_predicted_like_a_file(run, tmp_path):
    """--dataset_name: a local folder laid out as a Hub dataset (data/<split>-00000-of-00001.jsonl) stands in for
    one, which this machine cannot reach."""
    out, files = run
    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    rows = read_jsonl(files["predict"])
    serving_data.write_jsonl(folder / "test-00000-of-00001.jsonl", rows)
    serving_data.write_jsonl(folder / "train-00000-of-00001.jsonl", rows[:5])
    predict.main(predict.parse_config(["--model_dir", str(out), "--dataset_name", str(folder.parent),
                                       "--output_dir", str(tmp_path / "hub_out")]))
    predict.main(predict.parse_config(command(out, files["predict"], tmp_path / "file_out")[2:]))
    assert read_jsonl(tmp_path / "hub_out" / "predictions.jsonl") == read_jsonl(tmp_path / "file_out" /
                                                                                 "predictions.jsonl")


def test_refusals_are_one_line_each_and_leave_nothing_looking_complete(run, tmp_path):
    out, files = run
    bad = tmp_path / "bad"
    bad.mkdir()
    mixed = serving_data.write_jsonl(bad / "mixed.jsonl", [{"text": "好"}, {"text": 5}, {"text": None}])
    numbers = serving_data.write_jsonl(bad / "numbers.jsonl", [{"text": 1}, {"text": 2}])
    (bad / "empty.csv").write_text("")
    head = tmp_path / "headless"  # a classifier's config over weights without its head
    head.mkdir()
    for f in (REPO / "artifacts" / "minilm").iterdir():
        (head / f.name).symlink_to(f)
    (head / "config.json").unlink()
    config = json.loads((REPO / "artifacts" / "minilm" / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "architectures": ["BertForSequenceClassification"]}))
    target = tmp_path / "out"
    cases = [
        (["--predict_file", files["predict"], "--text_column", "txt"], "predict data has no column 'txt' (columns: "),
        (["--predict_file", mixed], "predict data row 1: column 'text' holds 5 (int), not text"),
        (["--predict_file", numbers], "predict data column 'text' holds int64 values, not text"),
        (["--predict_file", str(bad / "empty.csv")], f"data file is empty: {bad / 'empty.csv'}"),
        (["--predict_file", str(bad / "none.csv")], f"data file not found: {bad / 'none.csv'}"),
        (["--predict_file", files["predict"], "--model_dir", str(REPO / "artifacts" / "minilm")],
         "is not a sequence classifier (architectures: BertModel)"),
        (["--predict_file", files["predict"], "--model_dir", str(head)], "lack 2 of the classifier's tensors"),
        (["--predict_file", files["predict"], "--model_dir", str(bad)], "holds no classifier"),
        (["--predict_file", files["predict"], "--onnx_file", "model.int8.onnx"], "model.int8.onnx not found"),
        ([], "give the rows to predict: --predict_file or --dataset_name, one of them"),
        (["--predict_file", files["predict"], "--batch_size", "0"], "--batch_size, --window_rows and --max_length"),
        (["--predict_file", files["predict"], "--temperature", "2"], "unknown arguments: --temperature 2"),
    ]
    for flags, message in cases:
        argv = ["--model_dir", str(out), "--output_dir", str(target), *flags]
        with pytest.raises(RecipeError) as err:
            predict.main(predict.parse_config(argv))
        assert message in str(err.value) and "\n" not in str(err.value), (flags, str(err.value))
        assert not target.exists(), flags  # refused before any file
    # an unfinished prediction of another input is neither continued nor replaced without being asked
    target.mkdir()
    output.resume_point(target, {"model": "another"}, overwrite=False)
    differ = "model, model_bytes, model_mtime_ns, multi_label_threshold, rows, text_settings differ"
    with pytest.raises(RecipeError, match=rf"unfinished prediction of another model, input or settings \({differ}\)"):
        predict.main(predict.parse_config(["--model_dir", str(out), "--output_dir", str(target), "--predict_file",
                                           files["predict"]]))
    assert sorted(p.name for p in target.iterdir()) == sorted([output.PARTIAL, output.RECORD])
    predict.main(predict.parse_config(["--model_dir", str(out), "--output_dir", str(target), "--predict_file",
                                       files["predict"], "--overwrite_output_dir"]))
    assert len(read_jsonl(target / output.FINAL)) == 160


@pytest.mark.multiproc
def test_a_refusal_on_two_processes_is_one_line(run, tmp_path):
    out, _ = run
    mixed = serving_data.write_jsonl(tmp_path / "mixed.jsonl", [{"text": "好"}, {"text": 5}, {"text": None}])
    launch = [*launcher(), "launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
              "--main_process_port", str(free_port()), *command(out, mixed, tmp_path / "cmd")[1:]]
    proc = subprocess.run(launch, cwd=REPO, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == ["error: predict data row 1: column 'text' holds 5 (int), not text"]
    assert not (tmp_path / "cmd").exists()
