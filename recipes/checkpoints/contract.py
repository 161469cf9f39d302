"""The training contract: what a checkpoint binds the run that resumes it to.

A checkpoint records what training it is part of: every `Config` field that decides what is trained (COMPARED), the
global batch, and the identity of the model, the tokenizer and the training data as hashes of what they are, not of
where they are (a restart on another node mounts the same files elsewhere). A resume compares this run's contract
with the checkpoint's. Any difference stops the run in one line that lists each one with both values, unless
--force_resume is given; then each difference is applied for real (APPLIED says how) or, if it cannot be, refused
(REFUSED says why), and run_config.json records each change and the step it took effect at. Every other field is
EXEMPT, with its reason; tests/test_no_silent_change.py fails when a field is in none of the three, so a flag added
later must be classified.

The global batch's split into processes, micro-batch and accumulation may change at the same global batch (the
elastic resume: recipes/checkpoints/elastic.py), so those fields are exempt and the product is compared.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from recipes import RecipeError

# Changed on resume: refused even with --force_resume, since the checkpoint's training could not go on with them.
REFUSED = {
    "random_init": "the run's start: the checkpoint's weights grew from the other start",
    "task_name": "another task: other data, labels and scores",
    "dataset_name": "other training data",
    "dataset_config_name": "other training data",
    "text_column": "other training inputs",
    "text_pair_column": "other training inputs",
    "truncation": "other training inputs",
    "label_column": "other training labels",
    "problem_type": "another loss and head",
    "max_length": "other training inputs",
    "max_train_samples": "other training data",
    "validation_split": "another training split",
    "validation_split_name": "another training split",
    "metric_for_best_model": "best/ and the patience count were kept by the checkpoint's metric",
    "use_peft": "another set of trained parameters: the checkpoint's optimizer state is of the other set",
    "lora_r": "adapters of another shape than the checkpoint's",
    "lora_alpha": "another scale of the trained update: the same adapters would be another model",
    "lora_dropout": "the adapters' dropout is built into the model at the start (PEFT 0.21.2 has no setter)",
    "lora_target_modules": "adapters on other modules than the checkpoint's",
}
# Changed on resume with --force_resume: applied from the resumed step on, as said here.
APPLIED = {
    "seed": "the sample order of the rest of the run (the dropout streams continue the checkpoint's)",
    "learning_rate": "the optimizer groups' and the schedule's base rate: each step's rate is the new base times the "
                     "schedule's factor at that step",
    "weight_decay": "the decay of the matrices' optimizer group",
    "lr_scheduler_type": "the schedule rebuilt, at the checkpoint's step",
    "lr_scheduler_kwargs": "the schedule rebuilt, at the checkpoint's step",
    "warmup_steps": "the schedule rebuilt, at the checkpoint's step",
    "warmup_ratio": "the schedule rebuilt, at the checkpoint's step",
    "num_train_epochs": "the run's length and the schedule rebuilt for it",
    "max_train_steps": "the run's length and the schedule rebuilt for it",
    "max_grad_norm": "clipping of every later step",
    "class_weights": "the loss of every later step: weighted, and divided by the window's weight sum",
    "label_smoothing_factor": "the loss of every later step",
    "group_by_length": "the order of the later epochs (the resumed epoch keeps the checkpoint's)",
    "early_stopping_patience": "the patience of later evaluations",
    "load_best_model_at_end": "what final/ holds",
}
# Not compared: why a change of it does not change what is trained (or is compared another way).
EXEMPT = {
    "model_name_or_path": "a location: the model is compared by the hash of its files",
    "tokenizer_name": "a location: the tokenizer is compared by the hash of its files",
    "revision": "a location on the Hub: the model is compared by its resolved files or commit",
    "cache_dir": "where downloads are kept",
    "eval_report": "what is written after training, not what is trained",
    "calibrate": "applied to final/ after training, not to what is trained",
    "trust_remote_code": "a permission: the code it allows is among the model's hashed files",
    "ignore_mismatched_sizes": "start-up loading only: a resumed run's weights come from the checkpoint",
    "train_file": "a location: the training data are compared by fingerprint (rows, token ids, labels)",
    "validation_file": "evaluation",
    "multi_label_threshold": "evaluation",
    "test_split_name": "predictions after training",
    "predict_file": "predictions after training",
    "do_predict": "predictions after training",
    "do_train": "a resume always trains (flag_checks)",
    "do_eval": "evaluation",
    "metric_name": "evaluation",
    "max_eval_samples": "evaluation size",
    "per_device_eval_batch_size": "evaluation size",
    "eval_steps": "when to evaluate; evaluations do not change the weights",
    "output_dir": "output",
    "overwrite_output_dir": "output",
    "per_device_train_batch_size": "the split of the global batch, which is compared",
    "gradient_accumulation_steps": "the split of the global batch, which is compared",
    "auto_micro_batch": "the split of the global batch, which is compared",
    "data_parallel": "the split of the global batch over devices",
    "optim": "the same AdamW update by another kernel (kernels.apply_after_load applies the flag's)",
    "attn_implementation": "the same attention by another kernel",
    "sdpa_cudnn": "the same attention by another kernel",
    "tf32": "matmul precision on GPUs, like the launch config's precision",
    "pad_to_max_length": "padding: the same sums over the real tokens",
    "pad_to_multiple_of": "padding: the same sums over the real tokens",
    "padding_free": "padding: the same sums over the real tokens",
    "gradient_checkpointing": "the same gradients, recomputed",
    "torch_compile": "the same model, compiled",
    "torch_compile_mode": "the same model, compiled",
    "compile_regions": "the same model, compiled",
    "torch_compile_rng": "dropout masks from another generator, of the same distribution",
    "ddp_find_unused_parameters": "the same gradients",
    "checkpointing_steps": "checkpointing",
    "resume_from_checkpoint": "checkpointing",
    "save_total_limit": "checkpointing",
    "force_resume": "checkpointing",
    "record_ranks": "test records",
    "profile_steps": "profiling",
    "logging_steps": "logging",
    "ddp_timeout": "collective time-out",
    "cpu_threads": "threads",
    "report_to": "trackers",
    "push_to_hub": "upload",
    "hub_model_id": "upload",
    "hub_private_repo": "upload",
    "hub_token": "upload",
}
COMPARED = {**REFUSED, **APPLIED}
# What resuming with a change of the derived entries means (not flags).
DERIVED = {"model": "other model weights or config", "tokenizer": "another tokenizer", "data": "other training data"}
# Files of a model folder that make it what it is (its Python code and weights too), and of a tokenizer.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spm.model", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")
MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def is_model_file(path: Path) -> bool:
    return path.name in MODEL_FILES or path.suffix in (".py", *WEIGHT_SUFFIXES) or path.name.endswith(".index.json")


def folder_identity(source: str, keep, loading: dict) -> dict:
    """{file name: sha256} of the files of a local folder that `keep` accepts; for a Hub id {"hub": id, "commit":
    the commit its files were resolved at} (transformers records it on the config it loads)."""
    path = Path(source)
    if path.is_dir():
        return {p.name: file_sha256(p) for p in sorted(path.iterdir()) if p.is_file() and keep(p)}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, **loading)
    return {"hub": source, "commit": getattr(config, "_commit_hash", None) or loading.get("revision")}


def data_identity(dataset) -> dict:
    """Rows and a SHA-256 over the tokenized training set's token ids, token types and labels, in order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from recipes.inputs.data import SAMPLE_IDS

    columns = sorted(c for c in dataset.column_names if c not in (SAMPLE_IDS, "attention_mask"))
    digest = hashlib.sha256(json.dumps(columns).encode())

    def feed(array) -> None:
        if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
            feed(pc.list_value_length(array))
            feed(array.flatten())
        else:
            digest.update(array.to_numpy(zero_copy_only=False).tobytes())

    for batch in dataset.with_format("arrow").select_columns(columns).iter(batch_size=50_000):
        for name in columns:
            feed(batch.column(name).combine_chunks())
    return {"rows": len(dataset), "sha256": digest.hexdigest()}


@dataclass
class Change:
    """One difference between the checkpoint's contract and this run's."""

    name: str  # the flag, or model / tokenizer / data / global_batch
    before: object
    after: object
    refused: Optional[str] = None  # why it cannot be applied; None: applied with --force_resume

    def describe(self) -> str:
        if self.name == "global_batch":  # before/after: the batch layouts (recipes/checkpoints/elastic.py)
            from recipes.checkpoints import elastic

            return (f"global batch {elastic.describe_layout(self.before)} -> {elastic.describe_layout(self.after)} "
                    f"(to keep {elastic.global_batch(self.before)} samples per step: --gradient_accumulation_steps "
                    f"{elastic.ideal_accumulation(self.before, self.after)})")
        flag = f"--{self.name}" if self.name in COMPARED else self.name.replace("_", " ")
        return f"{flag} {short(self.before)} -> {short(self.after)}"


def short(value) -> str:
    """A value as the error line shows it; in a dict (files, data) each hash cut to 12 characters."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {str(v)[:12]}" for k, v in value.items()) + "}"
    return json.dumps(value)


@dataclass
class Contract:
    flags: dict  # COMPARED field: value
    layout: dict  # the global batch's split: per_device_train_batch_size, gradient_accumulation_steps, world_size
    model: dict
    tokenizer: dict
    data: dict
    changes: list = field(default_factory=list)  # [{name, before, after, step}]: applied changes, oldest first

    @classmethod
    def of(cls, cfg, train_ds, world: int) -> "Contract":
        """This run's contract (after the data are prepared: problem_type is resolved then)."""
        from recipes.checkpoints import longrun
        from recipes.model import source

        loading = source.loading_kwargs(cfg)
        flags = {name: getattr(cfg, name) for name in COMPARED}
        flags["metric_for_best_model"] = longrun.best_metric(cfg)
        tokenizer = cfg.tokenizer_name or cfg.model_name_or_path
        return cls(flags=flags, model=folder_identity(cfg.model_name_or_path, is_model_file, loading),
                   tokenizer=folder_identity(tokenizer, lambda p: p.name in TOKENIZER_FILES, loading),
                   data=data_identity(train_ds),
                   layout={"per_device_train_batch_size": cfg.per_device_train_batch_size,
                           "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "world_size": world})

    def record(self) -> dict:
        return asdict(self)

    def differences(self, saved: dict) -> list[Change]:
        """This run's differences from a checkpoint's recorded contract, flags first."""
        changes = [Change(name, saved["flags"].get(name), value, REFUSED.get(name))
                   for name, value in self.flags.items() if saved["flags"].get(name) != value]
        from recipes.checkpoints.elastic import global_batch

        if global_batch(saved["layout"]) != global_batch(self.layout):
            changes.append(Change("global_batch", saved["layout"], self.layout))
        for name, why in DERIVED.items():
            before, after = saved[name], getattr(self, name)
            if before != after and name != "data":  # the files that differ, each side ("-": not there)
                files = sorted(k for k in {*before, *after} if before.get(k) != after.get(k))
                before, after = ({k: side.get(k, "-") for k in files} for side in (before, after))
            if before != after:
                changes.append(Change(name, before, after, why))
        return changes

    def settle(self, start, force: bool):
        """Compare with the checkpoint `start` resumes; a RecipeError for what may not change, else `start` with
        the changes to apply and this contract's history. A fresh start returns it as it is."""
        if start.path is None:
            return start
        if start.contract is None:  # a checkpoint written before contracts: its seed and batch were all it kept
            return start
        changes = self.differences(start.contract)
        self.changes = list(start.contract.get("changes", []))
        if not changes:
            return start
        listed = "; ".join(c.describe() for c in changes)
        if not force:
            raise RecipeError(f"checkpoint {start.path} was written by another training: {listed}. Resume with the "
                              "same flags and files, or pass --force_resume to apply the changes from step "
                              f"{start.step} on")
        refused = [c for c in changes if c.refused]
        if refused:
            raise RecipeError(f"checkpoint {start.path}: --force_resume cannot apply "
                              + "; ".join(f"{c.describe()} ({c.refused})" for c in refused)
                              + ": start a new run (another --output_dir, or --overwrite_output_dir)")
        self.changes += [{"name": c.name, "before": c.before, "after": c.after, "step": start.step} for c in changes]
        if os.environ.get("RANK", "0") == "0":
            print(f"--force_resume: from step {start.step} on, " + "; ".join(c.describe() for c in changes))
        return type(start)(**{**vars(start), "changes": changes})


def apply_changes(changes: list, cfg, scheduler) -> None:
    """After the checkpoint is loaded: the forced changes that live in the optimizer and the schedule. The rate of
    each group becomes the new base times the (rebuilt) schedule's factor at the checkpoint's step, so the next step
    uses it; the schedule's base rates, which the checkpoint restored, become the new one. The others (clipping,
    order, length, patience) are read from the flags as the run goes."""
    if not changes:
        return
    names = {c.name for c in changes}
    lr_scheduler = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper keeps torch's scheduler
    # the stepping optimizer's groups: checkpoint.load_checkpoint pointed the schedule at them
    # (schedule_stepping_groups)
    groups = lr_scheduler.optimizer.param_groups
    if "weight_decay" in names:
        groups[0]["weight_decay"] = cfg.weight_decay
    lr_scheduler.base_lrs = [cfg.learning_rate for _ in lr_scheduler.base_lrs]
    rates = [base * factor(lr_scheduler.last_epoch) for base, factor in zip(lr_scheduler.base_lrs,
                                                                           lr_scheduler.lr_lambdas)]
    lr_scheduler._last_lr = rates  # what get_last_lr() reports: the rate the next step uses
    for g in groups:
        g["initial_lr"] = cfg.learning_rate
        g["lr"] = rates[0]
