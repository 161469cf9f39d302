"""--calibrate temperature: one temperature T fitted after training, folded into final/; --calibrate thresholds: one
threshold per label for a multi-label model, stored in final/config.json.

The evaluation final/ holds (recipes/outputs/report.py Kept) gives the validation logits. Its examples are split in two
halves by the run's seed: T minimises the negative log-likelihood of softmax(logits / T) on the first half (a golden
section search over log T: the NLL is convex in 1/T, so unimodal in log T), and the second half, which the fit never
saw, gives the expected calibration error and the NLL before and after. T is then folded into final/'s classifier:
the weight and bias of its last linear layer (the one with a row per label) are divided by T, so the logits of a plain
`AutoModelForSequenceClassification` / `pipeline()` load are the calibrated logits / T; argmax, hence accuracy, is
unchanged. final/config.json records `calibration_temperature` and the layer; eval_report/calibration.json the fit.
--calibrate thresholds (multi-label): the threshold that maximises each label's F1 on the validation outputs of
final/'s evaluation (the report's best_f1_threshold; --multi_label_threshold for a label without positives), stored in
final/config.json as `label_thresholds`. This run's predictions.jsonl and any later run's on that final/ predict each
label at its own threshold; evaluations keep --multi_label_threshold, since the thresholds were fitted on the very
validation set they would score.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes import RecipeError
from recipes.outputs import report

CHOICES = {"temperature": "single_label", "thresholds": "multi_label"}  # --calibrate: the problem type it serves
STORED = "label_thresholds"  # final/config.json: {label: threshold} of --calibrate thresholds
GOLDEN = (math.sqrt(5) - 1) / 2


def check(cfg) -> None:
    """Before any work: a calibration this run can make and store."""
    if cfg.calibrate is None:
        return
    if cfg.calibrate not in CHOICES:
        raise RecipeError(f"unknown --calibrate '{cfg.calibrate}' (one of {', '.join(CHOICES)})")
    if cfg.problem_type != CHOICES[cfg.calibrate]:
        raise RecipeError(f"--calibrate {cfg.calibrate} applies to {CHOICES[cfg.calibrate].replace('_', '-')} "
                          f"classification, not {cfg.problem_type}")
    if not (cfg.do_train and cfg.do_eval):
        raise RecipeError("--calibrate needs training and an evaluation: it is fitted on the validation set and "
                          "stored in final/")


def halves(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[: n // 2], order[n // 2:]


def nll(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> float:
    return float(F.cross_entropy(logits.double() / temperature, labels))


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, low: float = -4.0, high: float = 4.0,
                    steps: int = 80) -> float:
    """argmin over T of the NLL of softmax(logits / T), by golden section over log T in [low, high]."""
    a, b = low, high
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = nll(logits, labels, math.exp(c)), nll(logits, labels, math.exp(d))
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = nll(logits, labels, math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = nll(logits, labels, math.exp(d))
    return math.exp((a + b) / 2)


def head_layer(state_keys: dict, num_labels: int) -> str:
    """The name of the classifier's last linear layer: the one 2-D weight with a row per label (and its bias)."""
    rows = [k[: -len(".weight")] for k, shape in state_keys.items()
            if k.endswith(".weight") and len(shape) == 2 and shape[0] == num_labels]
    if len(rows) != 1:
        raise RecipeError(f"--calibrate: cannot tell the classifier's last layer among {rows or 'no layers'}")
    return rows[0]


def fold(final: Path, temperature: float) -> str:
    """Divide final/'s last classifier layer by `temperature`, in place; returns the layer's name."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config_path = final / "config.json"
    config = json.loads(config_path.read_text())
    index = final / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    shapes, where = {}, {}
    for name in files:
        with safe_open(final / name, "pt") as f:
            for key in f.keys():
                shapes[key], where[key] = f.get_slice(key).get_shape(), name
    layer = head_layer(shapes, len(config["id2label"]))
    name = where[layer + ".weight"]
    with safe_open(final / name, "pt") as f:
        tensors, metadata = {key: f.get_tensor(key) for key in f.keys()}, f.metadata()
    for key in (layer + ".weight", layer + ".bias"):
        if key in tensors:
            tensors[key] = (tensors[key].double() / temperature).to(tensors[key].dtype)
    save_file(tensors, str(final / name), metadata=metadata)
    config.update(calibration_temperature=temperature, calibration_layer=layer)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return layer


def label_thresholds(cfg, outputs: dict | None, what: str, names: list[str], model_config) -> torch.Tensor | None:
    """Multi-label thresholds per label, on every rank: with --calibrate thresholds, those that maximise each label's
    F1 on the validation outputs of final/'s evaluation (recipes/outputs/report.py; --multi_label_threshold for a label
    with no positive example); else those the model's config stores (a final/ calibrated so, loaded again); else
    None."""
    if cfg.problem_type != "multi_label":
        return None
    if cfg.calibrate == "thresholds" and outputs is not None and what != report.NOT_FINAL:
        per_label = report.multi_label(outputs["logits"], outputs["references"], names,
                                       cfg.multi_label_threshold)["per_label"]
        best = [per_label[n]["best_f1_threshold"]["threshold"] for n in names]
        return torch.tensor([cfg.multi_label_threshold if t is None else t for t in best])
    stored = getattr(model_config, STORED, None)
    return None if not stored else torch.tensor([float(stored[n]) for n in names])


def calibrate(cfg, out: Path, outputs: dict | None, what: str, names: list[str],
              thresholds: torch.Tensor | None = None, say=print) -> dict | None:
    """--calibrate on rank 0 after final/ is written. temperature: fit, measure on the held-out half, fold, record;
    thresholds: store `thresholds` (label_thresholds') in final/config.json, where predictions read them."""
    if cfg.calibrate is None:
        return None
    if outputs is None or what == report.NOT_FINAL:
        say(f"--calibrate: skipped: the logits of final/'s weights are not in this run ({what})")
        return None
    if cfg.calibrate == "thresholds":
        stored = dict(zip(names, thresholds.tolist()))
        path = out / "final" / "config.json"
        config = json.loads(path.read_text())
        config[STORED] = stored
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        result = {"method": "thresholds", "thresholds": stored, "fitted_on": f"{len(outputs['references'])} "
                  "validation examples (the scores at these thresholds on the same examples are optimistic)",
                  "evaluation": what, "step": outputs["step"]}
        (out / report.FOLDER).mkdir(parents=True, exist_ok=True)
        (out / report.FOLDER / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
        say(f"calibrated: per-label thresholds {stored} stored in final/config.json ({STORED})")
        return result
    logits, labels = outputs["logits"].double(), outputs["references"]
    fit, held = halves(len(labels), cfg.seed)
    temperature = fit_temperature(logits[fit], labels[fit])

    def ece(t: float) -> float:
        return report.calibration((logits[held] / t).softmax(dim=-1), labels[held])["ece"]

    result = {"method": "temperature", "temperature": temperature, "seed": cfg.seed, "fit_examples": len(fit),
              "held_out_examples": len(held), "ece_before": ece(1.0), "ece_after": ece(temperature),
              "nll_before": nll(logits[held], labels[held], 1.0),
              "nll_after": nll(logits[held], labels[held], temperature), "evaluation": what, "step": outputs["step"]}
    result["folded_into"] = fold(out / "final", temperature)
    if (out / "final" / "adapter").is_dir():  # --use_peft: the merged final/ is calibrated, the adapter's head is not
        result["adapter"] = "final/adapter/ keeps the uncalibrated head: load the merged final/ for calibrated output"
        say(f"--calibrate: {result['adapter']}")
    folder = out / report.FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"calibrated: temperature {temperature:.4f}, held-out ECE {result['ece_before']:.4f} -> "
        f"{result['ece_after']:.4f} ({len(held)} examples); folded into final/ {result['folded_into']}")
    return result
