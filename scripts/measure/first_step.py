"""What a user would write instead of the recipe, as far as its first optimizer step: scripts/measure/bench_startup.py's
baselines for the time from launch to step 1.

    accelerate launch --config_file accelerate_configs/single.yaml scripts/measure/first_step.py loop \
        --model_name_or_path artifacts/tiny-roberta --train_file train.csv --validation_file validation.csv \
        --output_dir runs/first_step_loop
    accelerate launch ... scripts/measure/first_step.py trainer ...   # the same through transformers.Trainer

Both read CSV files of `text,label` (integer labels) with `datasets.load_dataset("csv")`, tokenize both splits with
the model's tokenizer (truncation at --max_length, as the recipe's default 128) in one batched `map`, and train with
dynamic padding (DataCollatorWithPadding), AdamW and a linear schedule at --batch_size; each appends one line to
<output_dir>/metrics.jsonl after each optimizer step, the record scripts/measure/bench_startup.py watches for. The
Trainer logs to TensorBoard, as the recipe does by default; the loop logs nothing else. Neither imports anything of this
repository (a user's script would not), and each imports only what it uses: the loop never imports the Trainer.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("loop", "trainer"))
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--train_file", required=True)
    parser.add_argument("--validation_file", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_length", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=2e-5)
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def tokenized(args, tokenizer):
    """Both splits, tokenized: the validation set is prepared before training, as a user's script would."""
    from datasets import load_dataset

    splits = load_dataset("csv", data_files={"train": args.train_file, "validation": args.validation_file})
    splits = splits.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=args.max_length),
                        batched=True, remove_columns=["text"])
    return splits.rename_column("label", "labels")


def record(path: Path, step: int, loss: float) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "loss": loss}) + "\n")


def loop(args, out: Path) -> None:
    import torch
    from torch.utils.data import DataLoader
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                              get_linear_schedule_with_warmup)

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    train = tokenized(args, tokenizer)["train"].with_format("torch")
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=DataCollatorWithPadding(tokenizer))
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    scheduler = get_linear_schedule_with_warmup(optimizer, 0, args.max_steps)
    model.train()
    for step, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        record(out / "metrics.jsonl", step, loss.item())
        if step == args.max_steps:
            break


def trainer(args, out: Path) -> None:
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                              TrainerCallback, TrainingArguments)

    class Record(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                record(out / "metrics.jsonl", state.global_step, logs["loss"])

    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    splits = tokenized(args, tokenizer)
    model = AutoModelForSequenceClassification.from_pretrained(args.model_name_or_path, num_labels=2)
    targs = TrainingArguments(output_dir=str(out), per_device_train_batch_size=args.batch_size,
                              learning_rate=args.learning_rate, max_steps=args.max_steps, logging_steps=1,
                              report_to=["tensorboard"], save_strategy="no", eval_strategy="no", seed=args.seed,
                              lr_scheduler_type="linear", disable_tqdm=False)
    Trainer(model=model, args=targs, train_dataset=splits["train"],
            eval_dataset=splits["validation"], data_collator=DataCollatorWithPadding(tokenizer),
            callbacks=[Record()]).train()


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (loop if args.kind == "loop" else trainer)(args, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
