"""Our DeepSpeed JSONs in the most common training code: a transformers.Trainer script, the recipe's data and model.

    torchrun --nproc_per_node 2 scripts/trainer_deepspeed.py --deepspeed ds_configs/zero2.json --bf16 \
        --model_name_or_path artifacts/tiny-roberta --output_dir runs/trainer_zero2 --ddp_backend nccl
    python scripts/check_config.py accelerate_configs/zero2.yaml --trainer_args runs/trainer_zero2/training_args.json

Every TrainingArguments flag is accepted (--deepspeed <json>, --per_device_train_batch_size, --max_steps, ...);
the JSON's "auto" values are filled by transformers from them. On CPU processes pass --ddp_backend gloo and an fp32
JSON ("bf16": {"enabled": false}); tests/test_tutorials.py runs ZeRO-2 that way on 2 processes. The run leaves in
--output_dir: training_args.json (what check_config.py --trainer_args reads), ds_config_resolved.json (the JSON with
every "auto" filled, as the DeepSpeed engine got it), trainer_log.jsonl (the Trainer's log history) and final/.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformers import HfArgumentParser, Trainer, TrainingArguments

from recipes.cls import Config, build_model
from recipes.inputs import data
from recipes.model import source


@dataclass
class ScriptArgs:
    model_name_or_path: str = field(default="roberta-base", metadata={"help": "Hub id or local folder of the encoder"})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "keep the first N training examples"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "keep the first N validation examples"})
    max_length: int = field(default=128, metadata={"help": "truncate texts to this many tokens"})


def main(argv=None) -> dict:
    parser = HfArgumentParser((ScriptArgs, TrainingArguments), allow_abbrev=False)
    script, args = parser.parse_args_into_dataclasses(args=argv)
    cfg = Config(model_name_or_path=script.model_name_or_path, max_train_samples=script.max_train_samples,
                 max_eval_samples=script.max_eval_samples, max_length=script.max_length, seed=args.seed,
                 output_dir=args.output_dir)
    tokenizer = source.load_tokenizer(cfg)
    with args.main_process_first(desc="tokenize"):
        train_ds, eval_ds, names = data.prepare_datasets(cfg, tokenizer)
    model = build_model(cfg, names)
    # transformers 5.23.0 reads `accepts_loss_kwargs` from the model's forward signature (**kwargs present): it then
    # passes num_items_in_batch to a model whose loss ignores it and skips its own division of the loss by the
    # accumulation steps. The classifier computes a plain mean, so say it takes no loss kwargs.
    model.accepts_loss_kwargs = False
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                      data_collator=data.Collator(tokenizer, cfg.max_length,
                                                  pad_to_multiple_of=cfg.pad_to_multiple_of))
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(str(Path(args.output_dir) / "final"))
    if trainer.is_world_process_zero():
        out = Path(args.output_dir)
        (out / "training_args.json").write_text(json.dumps(args.to_dict(), indent=2, default=str) + "\n")
        if args.hf_deepspeed_config is not None:
            (out / "ds_config_resolved.json").write_text(json.dumps(args.hf_deepspeed_config.config, indent=2) + "\n")
        (out / "trainer_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trainer.state.log_history))
        print(f"trainer: {trainer.state.global_step} steps, eval loss {metrics['eval_loss']:.4f}")
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
