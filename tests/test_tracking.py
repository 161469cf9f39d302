"""Trackers, the model card and the Hub upload (recipes/outputs/tracking.py).

- One DDP launch on 2 processes with --report_to tensorboard,mlflow: MLflow's local store holds one run (rank 0's)
  whose logged values equal metrics.jsonl and eval.jsonl step by step; final/README.md, loaded back with
  huggingface_hub's ModelCard, holds eval.jsonl's last evaluation; the token given on the command line and in
  HF_TOKEN is in no file of the output folder, the MLflow store included.
- In-process: each start-up problem is one RecipeError line raised before any work (nothing written).
- The upload, against a local stand-in of the Hub API: the repo it creates, and final/ committed byte for byte.
"""
from __future__ import annotations

import base64
import json
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from helpers import TINY_FLAGS, no_gpu, read_jsonl, run_recipe
from recipes import RecipeError, cls
from recipes.outputs import records, tracking

SECRET = "hf_TrackingTestSecret0123456789"  # a made-up token: no file of a run may contain it
ENV_SECRET = "hf_EnvironmentSecret9876543210"
NEW_FLAGS = ("report_to", "push_to_hub", "hub_model_id", "hub_private_repo", "hub_token")


@pytest.fixture(scope="module")
def tracked_run(tiny_model, tmp_path_factory):
    """DDP on 2 processes, 4 steps, an evaluation every 2, TensorBoard and MLflow, the token on the command line."""
    out = tmp_path_factory.mktemp("tracked") / "run"
    # An empty MLFLOW_TRACKING_URI counts as unset: the recipe's default store, <output_dir>/mlruns, is what runs.
    run_recipe(out, "--max_train_steps", "4", "--eval_steps", "2", "--report_to", "tensorboard,mlflow",
               "--hub_model_id", "someone/tiny-cls", "--hub_token", SECRET,
               env={"MLFLOW_TRACKING_URI": "", "HF_TOKEN": ENV_SECRET})
    return out


def mlflow_run(out: Path):
    """The MLflow client on the run's store and the store's only run in experiment "cls"."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("cls").experiment_id])
    assert len(runs) == 1, f"{len(runs)} MLflow runs: only the main process may log"
    return client, runs[0]


@pytest.mark.multiproc
@no_gpu  # expects MULTI_CPU over gloo
def test_mlflow_holds_the_jsonl_values_step_by_step(tracked_run, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.17.2 refuses to read its file store otherwise
    client, run = mlflow_run(tracked_run)
    steps, evals = read_jsonl(tracked_run / "metrics.jsonl"), read_jsonl(tracked_run / "eval.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [e["step"] for e in evals] == [2, 4]

    def history(key):
        logged = client.get_metric_history(run.info.run_id, key)
        return [(m.step, m.value) for m in sorted(logged, key=lambda m: m.step)]

    for key, field in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm")):
        assert history(key) == [(r["step"], r[field]) for r in steps], key
    for metric in ("accuracy", "f1_macro", "loss"):
        assert history(f"eval/{metric}") == [(e["step"], e[metric]) for e in evals], metric
    params = run.data.params
    assert params["hub_token"] == records.REDACTED and params["report_to"] == "tensorboard,mlflow"
    assert float(params["learning_rate"]) == 1e-3 and int(params["max_train_steps"]) == 4
    assert any((tracked_run / "cls").rglob("events.out.tfevents.*")), "TensorBoard logged too"


@pytest.mark.multiproc
@no_gpu
def test_model_card_holds_the_last_evaluation_and_the_run(tracked_run):
    from huggingface_hub import ModelCard

    card = ModelCard.load(tracked_run / "final" / "README.md")
    last = read_jsonl(tracked_run / "eval.jsonl")[-1]
    best = json.loads((tracked_run / "best" / "best_model.json").read_text())
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == \
        {k: last[k] for k in ("accuracy", "f1_macro", "loss")}
    assert {r.dataset_split for r in card.data.eval_results} == {"validation"}
    assert card.data.model_name == "tiny-cls" and card.data.base_model is None  # a local folder is no Hub id
    assert card.data.pipeline_tag == "text-classification" and card.data.library_name == "transformers"
    resolved = json.loads((tracked_run / "run_config.json").read_text())
    text = card.text
    assert (f"| last | {last['step']} | {last['epoch']} | {last['accuracy']} | {last['f1_macro']} | "
            f"{last['loss']} |") in text
    assert (f"| best | {best['step']} | {best['epoch']} | {best['accuracy']} | {best['f1_macro']} | "
            f"{best['loss']} |") in text
    assert "Problem type: single_label_classification; labels: 0 " in text
    assert "- strategy: MULTI_CPU; world size: 2; precision: no" in text
    assert f"- hardware: 2 x {resolved['device']}" in text and "- learning_rate: 0.001" in text
    assert f"accelerate {resolved['versions']['accelerate']}" in text and "huggingface_hub " in text
    seconds = float(text.split("- training time: ")[1].split(" s")[0])
    assert seconds == pytest.approx(read_jsonl(tracked_run / "metrics.jsonl")[-1]["elapsed"], abs=0.05)


@pytest.mark.multiproc
@no_gpu
def test_no_token_in_any_file_of_the_run(tracked_run):
    resolved = json.loads((tracked_run / "run_config.json").read_text())
    config = resolved["config"]  # every new flag, the token redacted
    assert {k: config[k] for k in NEW_FLAGS} == {"report_to": "tensorboard,mlflow", "push_to_hub": False,
                                                 "hub_model_id": "someone/tiny-cls", "hub_private_repo": None,
                                                 "hub_token": records.REDACTED}
    files = [p for p in tracked_run.rglob("*") if p.is_file()]
    assert any("mlruns" in p.parts for p in files) and (tracked_run / "final" / "README.md") in files
    for path in files:
        data = path.read_bytes()
        assert SECRET.encode() not in data and ENV_SECRET.encode() not in data, path


def test_new_flags_are_in_help_and_their_meanings_parse():
    from recipes.config import build_parser

    text = build_parser().format_help()
    assert all(f"--{flag}" in text for flag in NEW_FLAGS)
    assert "mlflow" in text and "comet_ml" in text  # the tracker names come from Accelerate's own table
    defaults = cls.parse_config([])
    assert (defaults.report_to, defaults.push_to_hub, defaults.hub_private_repo) == ("tensorboard", False, None)
    cfg = cls.parse_config(["--push_to_hub", "--hub_private_repo", "--hub_model_id", "a/b", "--hub_token", SECRET])
    assert (cfg.push_to_hub, cfg.hub_private_repo, cfg.hub_model_id, cfg.hub_token) == (True, True, "a/b", SECRET)
    assert cls.parse_config(["--hub_private_repo", "false"]).hub_private_repo is False


@pytest.mark.parametrize("flag", ["--push_to_hub", "--hub_private_repo"])
def test_bad_boolean_value_is_one_error_line(flag, capsys):
    with pytest.raises(SystemExit) as caught:
        cls.parse_config([flag, "maybe"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert caught.value.code == 2 and len(errors) == 1 and flag in errors[0] and "maybe" in errors[0]


def test_redaction_keeps_an_unset_token_and_hides_a_set_one():
    assert records.tracker_config({"hub_token": None, "seed": 1}) == {"seed": 1}
    assert records.tracker_config({"hub_token": SECRET, "seed": 1}) == {"hub_token": records.REDACTED, "seed": 1}


# --- start-up checks, in-process -----------------------------------------------------------------------------------

def closed_port_endpoint() -> str:
    """An endpoint on this machine where nothing listens: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


STARTUP_PROBLEMS = {
    "unknown tracker": (["--report_to", "tensorboard,tensorbored"], "unknown --report_to 'tensorboard,tensorbored'"),
    "all with a name": (["--report_to", "all,mlflow"], "'all' and 'none' stand alone"),
    "empty report_to": (["--report_to", ","], "unknown --report_to ','"),
    "swanlab missing": (["--report_to", "swanlab"], "--report_to swanlab: the package is not installed: pip install "
                                                    "swanlab"),
    "comet_ml missing": (["--report_to", "comet_ml"], ": pip install comet-ml"),
    "empty token": (["--hub_token", " "], "--hub_token is empty"),
    "bad repo id": (["--hub_model_id", "me/my/model"], "--hub_model_id 'me/my/model' is not a Hub repo id"),
    "bad default repo": (["--push_to_hub", "--hub_token", SECRET, "--output_dir", "runs/a..b"],
                         "the --output_dir folder name (the default repo name) 'a..b' is not a Hub repo id"),
    "no token": (["--push_to_hub"], "--push_to_hub needs a Hub token"),
    "offline": (["--push_to_hub", "--hub_token", SECRET], "offline mode is on (HF_HUB_OFFLINE=1)"),
}


@pytest.mark.parametrize("case", STARTUP_PROBLEMS)
def test_startup_problem_is_one_line(case, monkeypatch):
    import huggingface_hub

    flags, message = STARTUP_PROBLEMS[case]
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no HF_TOKEN, no stored login
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeError) as caught:
        tracking.check_startup(cls.parse_config(flags))
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert SECRET not in str(caught.value)


def test_missing_mlflow_names_the_extra(monkeypatch):
    """The tracker the extra installs, as a machine without it sees it: Accelerate would drop it without a word."""
    monkeypatch.setattr(tracking, "get_available_trackers", lambda: [])
    with pytest.raises(RecipeError, match=r"^--report_to mlflow: the package is not installed: pip install "
                                          r"mlflow-skinny, or pip install -e \.\[trackers\] in this repository$"):
        tracking.check_startup(cls.parse_config(["--report_to", "mlflow"]))
    assert tracking.tracker_names("all") == []  # "all" is what is installed: nothing to refuse
    tracking.check_startup(cls.parse_config(["--report_to", "all"]))


def test_unreachable_hub_is_one_line(monkeypatch):
    """With the offline switch off, the Hub's client asks a local endpoint where nothing listens."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", closed_port_endpoint())
    with pytest.raises(RecipeError, match=f"the Hugging Face Hub at {constants.ENDPOINT} is unreachable") as caught:
        tracking.check_startup(cls.parse_config(["--push_to_hub", "--hub_token", SECRET]))
    assert "\n" not in str(caught.value) and SECRET not in str(caught.value)


def test_main_stops_before_any_work(tmp_path, monkeypatch):
    """The recipe's own main(): the tracker check comes before the model, the data and the output folder."""
    from recipes.checkpoints import preemption
    from recipes.model import source

    monkeypatch.setattr(preemption, "install_signal_handlers", lambda: None)  # not in pytest's own process
    monkeypatch.setattr(source, "check_model_source", lambda cfg: pytest.fail("reached the model source"))
    out = tmp_path / "run"
    with pytest.raises(RecipeError, match="unknown --report_to 'wandbb'"):
        cls.main(cls.parse_config([*TINY_FLAGS, "--output_dir", str(out), "--report_to", "wandbb"]))
    assert not out.exists()


def test_token_leaves_the_command_line(monkeypatch):
    """Trackers that record the command line (wandb's run metadata) see the token redacted."""
    argv = ["recipes/cls.py", "--hub_token", SECRET, f"--hub_token={SECRET}"]
    monkeypatch.setattr("sys.argv", argv)
    tracking.check_startup(cls.parse_config(argv[1:3]))
    import sys

    assert sys.argv == ["recipes/cls.py", "--hub_token", records.REDACTED, f"--hub_token={records.REDACTED}"]


def test_tracker_names_and_mlflow_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = cls.parse_config(["--report_to", "mlflow, tensorboard,mlflow", "--output_dir", str(tmp_path / "run")])
    assert tracking.prepare_trackers(cfg) == ["mlflow", "tensorboard"]
    import os

    assert os.environ["MLFLOW_TRACKING_URI"] == (tmp_path / "run" / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")  # the user's store wins
    tracking.prepare_trackers(cfg)
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://tracking.example:5000"
    assert tracking.prepare_trackers(cls.parse_config(["--report_to", "none"])) == []
    assert tracking.prepare_trackers(cls.parse_config([])) == ["tensorboard"]


# --- the upload ----------------------------------------------------------------------------------------------------

class FakeAccelerator:
    """The main process of a run, for `tracking.finish`: counts the barriers it reaches."""
    is_main_process = True

    def __init__(self):
        self.barriers = 0

    def wait_for_everyone(self):
        self.barriers += 1

    def print(self, *args):
        print(*args)


class HubStandIn(BaseHTTPRequestHandler):
    """The Hub API endpoints a token check and an upload of a folder call (huggingface_hub 2.4.0 without hf_xet:
    files go inline in the commit), answered as the Hub answers them, every request recorded for the test."""
    requests: list = []
    refuse_commits = False

    def do_GET(self):
        self.record(None)
        if self.path == "/api/whoami-v2":
            return self.answer({"name": "alice", "type": "user"})
        self.answer({"error": "not in the stand-in"}, 404)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path.split("/")[-2:-1] == ["commit"]:  # ndjson: a header line, then a line per file
            lines = [json.loads(line) for line in body.decode().splitlines()]
            self.record({v["value"]["path"]: base64.b64decode(v["value"]["content"]) for v in lines
                         if v["key"] == "file"})
            if self.refuse_commits:
                return self.answer({"error": "You don't have the rights to create a commit"}, 403)
            repo = self.path.removeprefix("/api/models/").split("/commit/")[0]
            return self.answer({"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/{'0' * 40}",
                                "commitOid": "0" * 40})
        payload = json.loads(body or b"{}")
        self.record(payload)
        if self.path == "/api/repos/create":
            owner = payload.get("organization") or "alice"
            return self.answer({"url": f"http://{self.headers['Host']}/{owner}/{payload['name']}"})
        if self.path == "/api/validate-yaml":
            return self.answer({"errors": [], "warnings": []})
        if "/preupload/" in self.path:
            return self.answer({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                          for f in payload["files"]]})
        self.answer({"error": "not in the stand-in"}, 404)

    def record(self, body):
        self.requests.append((self.command, self.path, self.headers.get("Authorization"), body))

    def answer(self, content: dict, status: int = 200):
        data = json.dumps(content).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # no line per request on stderr
        pass


@pytest.fixture
def hub(monkeypatch):
    """A local stand-in of the Hub API; huggingface_hub pointed at it with the offline switch off."""
    from huggingface_hub import constants

    handler = type("Handler", (HubStandIn,), {"requests": [], "refuse_commits": False})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield handler
    server.shutdown()
    server.server_close()


@pytest.mark.multiproc
@no_gpu
@pytest.mark.parametrize("private", [True, None])
def test_push_uploads_final_to_the_repo(tracked_run, tmp_path, hub, private):
    """The recipe's start-up check and end (check_startup, finish) against the stand-in: final/ committed whole."""
    out = tmp_path / "run"
    shutil.copytree(tracked_run, out)
    flags = ["--output_dir", str(out), "--push_to_hub", "--hub_token", SECRET, "--report_to", "none"]
    if private:
        flags += ["--hub_model_id", "team/tiny-cls", "--hub_private_repo"]
    cfg = cls.parse_config([*TINY_FLAGS, *flags])
    tracking.check_startup(cfg)
    accelerator = FakeAccelerator()
    tracking.finish(cfg, accelerator, out, read_jsonl(out / "eval.jsonl")[-1])
    assert accelerator.barriers == 1
    # huggingface_hub 2.4.0 also fetches a registry for its user-agent string (/api/agent-harnesses): not asserted
    wanted = ["/api/whoami-v2", "/api/repos/create", "/api/validate-yaml", "preupload", "commit"]
    requests = [(path.split("/")[-2] if "/models/" in path else path, auth, body)
                for _, path, auth, body in hub.requests]
    calls = {name: body for name, _, body in requests if name in wanted}
    assert list(calls) == wanted
    assert {auth for name, auth, _ in requests if name in wanted} == {f"Bearer {SECRET}"}
    create = calls["/api/repos/create"]
    if private:
        assert (create["organization"], create["name"], create["visibility"]) == ("team", "tiny-cls", "private")
    else:  # no --hub_model_id: the output folder's name, in the token owner's space, the account's visibility
        assert (create["organization"], create["name"], "visibility" in create) == (None, "run", False)
    repo = "team/tiny-cls" if private else "alice/run"
    assert hub.requests[-1][1] == f"/api/models/{repo}/commit/main"
    final = {str(p.relative_to(out / "final")): p.read_bytes() for p in (out / "final").rglob("*") if p.is_file()}
    assert calls["commit"] == final and {"README.md", "config.json", "model.safetensors"} <= set(final)
    assert calls["/api/validate-yaml"]["content"] == (out / "final" / "README.md").read_text()
    assert all(SECRET.encode() not in data for data in final.values())


@pytest.mark.multiproc
@no_gpu
def test_failed_upload_is_one_line_after_the_barrier(tracked_run, tmp_path, hub):
    hub.refuse_commits = True
    out = tmp_path / "run"
    shutil.copytree(tracked_run, out)
    cfg = cls.parse_config([*TINY_FLAGS, "--output_dir", str(out), "--push_to_hub", "--hub_token", SECRET])
    accelerator = FakeAccelerator()
    with pytest.raises(RecipeError, match=r"uploading .*final to the Hub failed \(403 .*\); it is complete on disk: "
                                          r"upload it with `hf upload run ") as caught:
        tracking.finish(cfg, accelerator, out, read_jsonl(out / "eval.jsonl")[-1])
    assert accelerator.barriers == 1 and "\n" not in str(caught.value) and SECRET not in str(caught.value)
