"""Padding-free attention on a CUDA GPU, in-process: is it exact, and what does it save, per attention path.

    .venv-gpu/bin/python scripts/measure/padding_free_gpu.py    # after `make gpu-check` has made .venv-gpu
    # on one H100 the three default sizes took over 170 s; --batch_sizes 64,256 --batches 10 took 128 s

On the roberta-base shape (random init, seed 42, dropout 0) and the default data's real lengths (the first
--batches micro-batches of each --batch_sizes, the recipe's own loaders and collators), for three ways to run a
micro-batch:
- padded: dynamic padding, `sdpa` (what the recipe runs without --padding_free);
- varlen: --padding_free with torch's varlen flash kernel (recipes/model/padding_free.py `_VARLEN`: CUDA, bf16, no
  attention dropout);
- grouped: --padding_free with the kernel switched off, so that attention runs per length group through SDPA (what
  the CPU and a model with attention dropout run).
1. Exactness, eval mode: max |logit difference| of each padding-free path from the padded model's, in bf16 autocast
   and in fp32 (fp32 never takes varlen: flash kernels are fp16/bf16 only).
2. Speed, train mode, bf16 autocast: forward + backward of the same micro-batches, 3 interleaved rounds after a
   warm-up, the best round of each; the speed-up over padded beside the bound P / R (padded positions / real tokens).
   Then once on micro-batches of shapes never run before (the same samples shuffled with another seed, each path
   once: in a real run nearly every packed row has a new length R, so every linear layer sees a new shape, while
   dynamic padding's lengths repeat; the best-of-3 rounds above run shapes seen before).
3. The GPU's own time: one more round of each path under torch.profiler, the sum of its CUDA kernels' durations.
   Its ratio (padded / path) is what the path saves on the device; the kernel time over the wall time of the round
   says whether the GPU was the bound (near 1) or waited on the host (Python, kernel launches: near 0), where no
   method that removes positions can show its saving in the wall time.
Results: results/gpu_check_padding_free_<date>_<gpu slug>.{json,md} (beside make gpu-check's own).

    .venv-gpu/bin/python scripts/measure/padding_free_gpu.py --first_steps 60 --batch_sizes 16  # 2 min on one H100

instead times the start of a run: the first N micro-batches of each VARIANTS entry (dynamic padding with and without
SDPA's cuDNN backend and --pad_to_multiple_of 8, padding-free with and without --pad_to_multiple_of 64), each variant
in a process of its own and each micro-batch alone, so that the cost of preparing shapes on first use shows:
results/gpu_check_first_steps_<date>_<gpu slug>.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from recipes import cls
from recipes.inputs import data
from recipes.model import padding_free as pf
from recipes.model.source import load_tokenizer
from scripts.measure.bench_report import slug, unused_stem

REPO = Path(__file__).resolve().parents[2]
AUTOCAST = "cuda"  # the device type of the bf16 autocast
KERNEL = pf._varlen()  # torch's varlen kernel as recipes/model/padding_free.py found it; forward() switches it per path


def model_of(shape: Path, multiple: int | None = None):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(shape, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(42)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    pf.apply(types.SimpleNamespace(padding_free=True, attn_implementation=None, pad_to_multiple_of=multiple), model)
    return model.cuda()


def micro_batches(cfg, train, evals, tokenizer, padding_free: bool, count: int) -> list:
    cfg.padding_free = padding_free
    loader = data.build_loaders(cfg, train, evals, tokenizer, 1).train
    out = []
    for batch in loader:
        out.append({k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()})
        if len(out) == count:
            return out
    return out


def forward(model, batch, path: str):
    pf._VARLEN = KERNEL if path == "varlen" else None
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs).logits.float()


def exactness(model, padded, packed) -> dict:
    model.eval()
    worst = {}
    with torch.no_grad():
        for precision in ("bf16", "fp32"):
            for path in ("varlen", "grouped"):
                if precision == "fp32" and path == "varlen":
                    continue
                diff = 0.0
                for a, b in zip(padded, packed):
                    with torch.autocast(AUTOCAST, torch.bfloat16, enabled=precision == "bf16"):
                        diff = max(diff, (forward(model, a, "padded") - forward(model, b, path)).abs().max().item())
                worst[f"{path}_{precision}"] = diff
    return worst


def timed(model, batches, path: str) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        with torch.autocast(AUTOCAST, torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(forward(model, batch, path), batch["labels"])
        loss.backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def kernel_seconds(model, batches, path: str) -> tuple[float, float]:
    """(sum of the CUDA kernels' durations, wall time) of one round under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(model, batches, path)
    kernels = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    return kernels / 1e6, wall


def speed(model, padded, packed, unseen: dict, rounds: int = 3) -> dict:
    """`unseen`: {"padded": ..., "varlen": ...} micro-batches of other samples, run once each after the warm-up."""
    model.train()
    sets = {"padded": padded, "varlen": packed, "grouped": packed}
    for path, batches in sets.items():
        timed(model, batches[:4], path)  # warm-up: kernels chosen, allocator grown
    first = {path: timed(model, batches, path) for path, batches in unseen.items()}
    seconds = {path: [] for path in sets}
    for r in range(rounds):
        for path in (list(sets) if r % 2 == 0 else list(sets)[::-1]):
            seconds[path].append(timed(model, sets[path], path))
    real = sum(int(b["attention_mask"].sum()) for b in padded)
    positions = sum(b["attention_mask"].numel() for b in padded)
    best = {path: min(v) for path, v in seconds.items()}
    device = {path: kernel_seconds(model, sets[path], path) for path in sets}
    return {"seconds": seconds, "unseen_seconds": first, "unseen_batches": len(unseen["padded"]),
            "unseen_speedup": first["padded"] / first["varlen"], "real_tokens": real, "padded_positions": positions,
            "bound": positions / real,
            "speedup": {path: best["padded"] / best[path] for path in ("varlen", "grouped")},
            "kernel_seconds": {path: k for path, (k, _) in device.items()},
            "kernel_share": {path: k / wall for path, (k, wall) in device.items()},
            "kernel_speedup": {path: device["padded"][0] / device[path][0] if device[path][0] else float("nan")
                               for path in ("varlen", "grouped")}}  # nan: no CUDA kernel recorded


# --first_steps: the start of a run, each variant in a process of its own (what one variant's first shapes cost must
# not be paid by another's: cuBLAS, cuDNN and torch cache per shape): name -> (--padding_free, --pad_to_multiple_of,
# cuDNN attention allowed). In launch order.
VARIANTS = {"padded": (False, None, True), "padded_8": (False, 8, True), "padded_no_cudnn": (False, None, False),
            "padded_8_no_cudnn": (False, 8, False), "varlen": (True, None, True), "varlen_64": (True, 64, True)}


def first_steps(shape: Path, variant: str, size: int, steps: int) -> dict:
    """One variant's first `steps` micro-batches of a run (the default data's first samples, the recipe's loaders and
    collators), each timed alone: forward + backward in bf16 autocast, synchronised; one micro-batch before them
    pays what any first step pays (CUDA context, library handles)."""
    packed, multiple, cudnn = VARIANTS[variant]
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    model = model_of(shape, multiple).train()
    cfg = cls.parse_config(["--model_name_or_path", str(shape), "--per_device_train_batch_size", str(size),
                            "--max_train_samples", str(size * (steps + 1)), "--max_length", "128",
                            *(["--pad_to_multiple_of", str(multiple)] if multiple else [])])
    tokenizer = load_tokenizer(cfg)
    train, evals, _ = data.prepare_datasets(cfg, tokenizer)
    batches = micro_batches(cfg, train, evals, tokenizer, packed, steps + 1)
    path = "varlen" if packed else "padded"
    timed(model, batches[:1], path)
    ms = [1e3 * timed(model, [batch], path) for batch in batches[1:]]
    half = len(ms) // 2
    return {"variant": variant, "batch": size, "steps": len(ms), "ms": ms, "total_s": sum(ms) / 1e3,
            "first_half_ms": sum(ms[:half]) / half, "second_half_ms": sum(ms[half:]) / (len(ms) - half),
            "median_ms": sorted(ms)[half], "shapes": len({tuple(b["input_ids"].shape) for b in batches[1:]}),
            "positions": sum(b["input_ids"].numel() for b in batches[1:])}


def first_steps_table(stem: Path, args) -> None:
    """Every variant in its own process, then <stem>.{json,md}."""
    rows = []
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--first_steps", str(args.first_steps),
                               "--batch_sizes", args.batch_sizes.split(",")[0], "--shape", args.shape],
                              capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(f"{variant}: failed\n{proc.stderr[-2000:]}")
            continue
        rows.append(json.loads(lines[-1]))
        print({k: v for k, v in rows[-1].items() if k != "ms"}, flush=True)
    name = torch.cuda.get_device_name()
    stem.with_suffix(".json").write_text(json.dumps({"gpu": name, "date": str(dt.date.today()),
                                                     "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    lines = [f"# The first steps of a run on {name} ({dt.date.today()}, torch {torch.__version__})", "",
             "scripts/measure/padding_free_gpu.py --first_steps: roberta-base shape, random init, dropout 0, "
             "bf16 autocast, "
             "the default data's first micro-batches; each variant in a process of its own; every micro-batch "
             "timed alone (forward + backward, synchronised) after one untimed.", "",
             "| variant | batch | micro-batches | distinct shapes | positions | total s | ms mean, first half | "
             "ms mean, second half | ms median |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['batch']} | {r['steps']} | {r['shapes']} | {r['positions']} | "
                     f"{r['total_s']:.2f} | {r['first_half_ms']:.1f} | {r['second_half_ms']:.1f} | "
                     f"{r['median_ms']:.1f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(stem.with_suffix(".md").read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=str(REPO / "artifacts" / "roberta-base-shape"))
    parser.add_argument("--batch_sizes", default="16,64,256")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--results", default=str(REPO / "results"))
    parser.add_argument("--first_steps", type=int, default=0,
                        help="instead: time the first N micro-batches of a run per variant (VARIANTS), at the first "
                             "--batch_sizes")
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # one --first_steps process
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or KERNEL is None:
        print(f"padding_free_gpu: needs a CUDA GPU and torch's varlen_attn (torch {torch.__version__}): nothing run")
        return 0
    if args.variant:
        print(json.dumps(first_steps(Path(args.shape), args.variant, int(args.batch_sizes.split(",")[0]),
                                     args.first_steps)))
        return 0
    if args.first_steps:
        results = Path(args.results)
        first_steps_table(results / unused_stem(results, f"gpu_check_first_steps_{dt.date.today()}_"
                                                          f"{slug(torch.cuda.get_device_name())}"), args)
        return 0
    model = model_of(Path(args.shape))
    name = torch.cuda.get_device_name()
    results = Path(args.results)
    stem = results / unused_stem(results, f"gpu_check_padding_free_{dt.date.today()}_{slug(name)}")
    rows = []
    for size in [int(s) for s in args.batch_sizes.split(",")]:
        cfg = cls.parse_config(["--model_name_or_path", args.shape, "--per_device_train_batch_size", str(size),
                                "--max_train_samples", str(size * args.batches), "--max_length", "128"])
        tokenizer = load_tokenizer(cfg)
        train, evals, _ = data.prepare_datasets(cfg, tokenizer)
        padded = micro_batches(cfg, train, evals, tokenizer, False, args.batches)
        packed = micro_batches(cfg, train, evals, tokenizer, True, args.batches)
        cfg.seed += 1  # the same samples in other micro-batches: other lengths
        unseen = {"padded": micro_batches(cfg, train, evals, tokenizer, False, args.batches),
                  "varlen": micro_batches(cfg, train, evals, tokenizer, True, args.batches)}
        assert [b["labels"].tolist() for b in padded] == [b["labels"].tolist() for b in packed]
        row = {"batch": size, "batches": len(padded), "max_abs_logit_diff": exactness(model, padded, packed),
               **speed(model, padded, packed, unseen)}
        rows.append(row)
        print(json.dumps(row))
        pf._VARLEN = KERNEL
        # after every batch size: a run cut short by a time limit keeps the sizes it finished
        write_results({"gpu": name, "date": str(dt.date.today()), "torch": torch.__version__, "shape": args.shape,
                       "rows": rows}, stem)
    print(stem.with_suffix(".md").read_text())
    return 0


def write_results(result: dict, stem: Path) -> None:
    """<stem>.json (the rows as measured) and <stem>.md (their table)."""
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Padding-free attention on {result['gpu']} ({result['date']}, torch {result['torch']})", "",
             "scripts/measure/padding_free_gpu.py: roberta-base shape, random init (seed 42), dropout 0, "
             "the default data's "
             "first micro-batches; speed: forward + backward in bf16 autocast, best of 3 interleaved rounds; kernel "
             "time: the sum of the CUDA kernels' durations in one more round under torch.profiler (GPU busy: kernel "
             "time / wall time of that round); unseen: varlen / dynamic padding once on the same samples shuffled "
             "with another seed, shapes not run before.", "",
             "| batch | micro-batches | bound P/R | varlen speed-up | grouped speed-up | varlen / bound | "
             "ms per micro-batch padded / varlen | unseen speed-up varlen | kernel-time speed-up varlen | "
             "GPU busy padded / varlen | "
             "max \\|Δlogit\\| varlen bf16 | grouped bf16 | grouped fp32 |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row in result["rows"]:
        d, s = row["max_abs_logit_diff"], row["speedup"]
        ms = {path: 1e3 * min(v) / row["batches"] for path, v in row["seconds"].items()}
        busy = row["kernel_share"]
        unseen = f"{row['unseen_speedup']:.3f}x" if "unseen_speedup" in row else "-"  # files before it was measured
        lines.append(f"| {row['batch']} | {row['batches']} | {row['bound']:.3f} | {s['varlen']:.3f}x | "
                     f"{s['grouped']:.3f}x | {s['varlen'] / row['bound']:.3f} | {ms['padded']:.1f} / "
                     f"{ms['varlen']:.1f} | {unseen} | {row['kernel_speedup']['varlen']:.3f}x | {busy['padded']:.2f} / "
                     f"{busy['varlen']:.2f} | {d['varlen_bf16']:.2e} | {d['grouped_bf16']:.2e} | "
                     f"{d['grouped_fp32']:.2e} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
