"""The kernel defaults on this device, in-process: SDPA against eager attention and fused AdamW against torch's default
AdamW, in alternating blocks, each ratio with its 95% t interval over the block pairs.

    python scripts/measure/bench_kernels.py    # CPU: the tiny model and the roberta-base shape; 6.5 minutes on 2 cores

Why in-process: `make bench`'s whole-run rows (`unfused`, `eager_attn`) compare separate launches, where a kernel's
share of a step (one AdamW step is 1 ms of the tiny model's 70 ms step) sits inside the noise between processes.
Here both sides run in one process, in turn, on the same micro-batches:
- attention: forward + backward in train mode (the model's own dropout) of the same micro-batches of the default data
  (the recipe's loaders, dynamic padding), one model with `sdpa` and a copy with `eager`; ratio per block pair: eager
  seconds / SDPA seconds (> 1: SDPA faster);
- optimizer: the AdamW step alone over the model's parameters with fixed gradients, `fused=True` against torch's
  default for the device (a per-parameter loop on CPU, foreach on CUDA); ratio: default seconds / fused seconds (> 1:
  fused faster).
Before timing, each pair is checked to compute the same thing: the largest |logit difference| in eval mode on the
first micro-batch and the largest |parameter difference| after one step from the same state (recorded).
Results: results/<date>_kernels_<device>_<host>.{json,md}.
"""
from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from recipes import cls
from recipes.inputs import data
from recipes.model.source import load_tokenizer
from scripts.measure.bench import hardware
from scripts.measure.bench_report import slug
from scripts.sweep import summary

REPO = Path(__file__).resolve().parents[2]
# model -> (folder, random init, micro-batch, micro-batches per attention block, optimizer steps per block)
MODELS = {"tiny": ("artifacts/tiny-roberta", False, 16, 8, 50),
          "roberta-base": ("artifacts/roberta-base-shape", True, 8, 2, 3)}


def build(folder: str, random_init: bool):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(42)
    if random_init:
        config = AutoConfig.from_pretrained(REPO / folder, num_labels=2)
        return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    return AutoModelForSequenceClassification.from_pretrained(REPO / folder, num_labels=2, attn_implementation="sdpa")


def micro_batches(folder: str, size: int, count: int) -> list:
    cfg = cls.parse_config(["--model_name_or_path", str(REPO / folder), "--per_device_train_batch_size", str(size),
                            "--max_train_samples", str(size * count), "--max_length", "128"])
    tokenizer = load_tokenizer(cfg)
    train, evals, _ = data.prepare_datasets(cfg, tokenizer)
    return list(data.build_loaders(cfg, train, evals, tokenizer, 1).train)[:count]


def forward_backward(model, batches) -> float:
    start = time.perf_counter()
    for batch in batches:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        F.cross_entropy(logits, batch["labels"]).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def optimizer_steps(optimizer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return time.perf_counter() - start


def blocks(sides: dict, pairs: int) -> list:
    """Seconds per side per block, the sides' order alternating from pair to pair, after one untimed block each;
    returns the per-pair ratio first side's seconds / second side's."""
    run_a, run_b = sides.values()  # the names say which is which; the ratio is the first's time over the second's
    run_a(), run_b()
    ratios = []
    for i in range(pairs):
        if i % 2 == 0:
            ta, tb = run_a(), run_b()
        else:
            tb, ta = run_b(), run_a()
        ratios.append(ta / tb)
    return ratios


def measure(name: str, pairs: int) -> dict:
    folder, random_init, size, per_block, steps = MODELS[name]
    sdpa = build(folder, random_init)
    eager = copy.deepcopy(sdpa)
    eager.set_attn_implementation("eager")
    batches = micro_batches(folder, size, per_block)
    sdpa.eval(), eager.eval()
    with torch.no_grad():
        inputs = {k: v for k, v in batches[0].items() if k != "labels"}
        logit_diff = (sdpa(**inputs).logits - eager(**inputs).logits).abs().max().item()
    sdpa.train(), eager.train()
    attention = blocks({"eager": lambda: forward_backward(eager, batches),
                        "sdpa": lambda: forward_backward(sdpa, batches)}, pairs)

    params = [p for p in sdpa.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3
    twins = [p.detach().clone().requires_grad_() for p in params]
    for p, twin in zip(params, twins):
        twin.grad = p.grad.clone()
    fused, default = torch.optim.AdamW(params, lr=1e-3, fused=True), torch.optim.AdamW(twins, lr=1e-3)
    fused.step(), default.step()  # one step from the same state: the same update, rounded differently
    param_diff = max((p - t).abs().max().item() for p, t in zip(params, twins))
    optimizer = blocks({"default": lambda: optimizer_steps(default, steps),
                        "fused": lambda: optimizer_steps(fused, steps)}, pairs)
    return {"model": name, "micro_batch": size, "micro_batches_per_block": per_block, "optimizer_steps_per_block": steps,
            "parameters": sum(p.numel() for p in params), "max_abs_logit_diff_eval": logit_diff,
            "max_abs_param_diff_one_step": param_diff,
            "sdpa_speedup_over_eager": {**summary(attention), "per_pair": attention},
            "fused_speedup_over_default": {**summary(optimizer), "per_pair": optimizer}}


def verdict(stats: dict) -> str:
    low, high = stats["ci95"]
    return "faster" if low > 1 else "slower" if high < 1 else "not decided"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--pairs", type=int, default=20, help="block pairs per comparison")
    parser.add_argument("--results", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    rows = [measure(name, args.pairs) for name in args.models]
    hw = hardware()
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{dt.date.today()}_kernels_{slug(hw['device'])}_{slug(hw['host'])}"
    result = {"date": str(dt.date.today()), "hardware": hw, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "pairs": args.pairs, "rows": rows}
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Kernel defaults on CPU, in-process ({result['date']}, torch {result['torch']}, "
             f"{result['threads']} threads)", "",
             f"`python scripts/measure/bench_kernels.py`: {args.pairs} block pairs per comparison, the sides' order "
             "alternating; mean of the per-pair ratios with its 95% t interval.", "",
             "| model | parameters | SDPA / eager attention speed | 95% t | | fused / default AdamW speed | 95% t | "
             "| max \\|Δlogit\\| | max \\|Δparam\\| |", "|---|--:|--:|--:|---|--:|--:|---|--:|--:|"]
    for row in rows:
        a, o = row["sdpa_speedup_over_eager"], row["fused_speedup_over_default"]
        lines.append(f"| {row['model']} | {row['parameters'] / 1e6:.1f} M | {a['mean']:.3f} | {a['ci95'][0]:.3f}-"
                     f"{a['ci95'][1]:.3f} | {verdict(a)} | {o['mean']:.3f} | {o['ci95'][0]:.3f}-{o['ci95'][1]:.3f} | "
                     f"{verdict(o)} | {row['max_abs_logit_diff_eval']:.1e} | {row['max_abs_param_diff_one_step']:.1e} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
