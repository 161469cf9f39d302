"""The training contract: what a checkpoint binds the run that resumes it to.

A checkpoint records what training it is part of: every flag that decides what is trained, the global batch, the
identity of the model, the tokenizer, the training and evaluation data (hashes of what they are, not of where they
are: a restart on another node mounts the same files elsewhere), and the launch (strategy, precision, DeepSpeed's and
FSDP's settings). A resume compares this run's contract with the checkpoint's. Any difference stops the run in one
line that lists each one with both values, unless --force_resume is given; then each difference is applied for real
or, if it cannot be, refused, and run_config.json records each change and the step it took effect at. Each flag's
rule sits beside the flag in recipes/config.py (`Rule`: refused, applied or exempt, with its reason); a flag without
one fails tests/test_no_silent_change.py.

The global batch's split into processes, micro-batch and accumulation may change at the same global batch (the
elastic resume: recipes/checkpoints/elastic.py), so those flags are exempt and the product is compared.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from recipes import RecipeError
from recipes.model.identity import TOKENIZER_FILES, folder_identity, is_model_file

# Why each compared flag's change is refused or how it is applied: shared where the answer is the same.
OTHER_DATA = "other training data or inputs: the checkpoint trained on the others"
OTHER_ADAPTERS = ("other adapters: their set, shape, scale, dropout and modules are built in at the start (PEFT "
                  "0.21.2 sets none of them later)")
ORDER = ("the sample order from the next epoch on: the epoch in progress keeps the checkpoint's (the dropout streams "
         "continue the checkpoint's)")
OPTIMIZER = ("the rates, decay and schedule from the checkpoint's step (each step's rate the new base times the "
             "rebuilt schedule's factor there), and the run's length")
EVERY_STEP = "every later step's clipping, loss or matmul precision"
EVALUATIONS = "later evaluations; best/ and the patience count restart (they compared other evaluations)"


@dataclass(frozen=True)
class Rule:
    """What a resume does when a flag differs from its checkpoint's: refused even with --force_resume, applied with
    it (from the checkpoint's step, as `why` says), or exempt (not compared: why not). Every Config field has one,
    beside the flag in recipes/config.py."""

    kind: str  # "refused" | "applied" | "exempt"
    why: str


def refused(why: str) -> Rule:
    return Rule("refused", why)


def applied(why: str) -> Rule:
    return Rule("applied", why)


def exempt(why: str) -> Rule:
    return Rule("exempt", why)


def rules(config) -> dict[str, Rule]:
    """Each flag's Rule, read from the config dataclass (or an instance of it)."""
    return {f.name: f.metadata["resume"] for f in fields(config)}


def compared(config) -> dict[str, Rule]:
    return {name: rule for name, rule in rules(config).items() if rule.kind != "exempt"}


# What resuming with a change of the derived entries means (not flags).
DERIVED = {"model": "other model weights or config", "tokenizer": "another tokenizer", "data": "other training data"}
# The evaluation sets' fingerprints: applied with --force_resume, restarting best/ and the patience count.
EVALUATION = "evaluation"
# The launch a checkpoint binds a resume to (launch_identity): the strategy's family, the precision, DeepSpeed's
# training keys, FSDP's settings. A difference is refused (it could not load, or would train otherwise: LAUNCH_WHY)
# unless LAUNCH_APPLIED says how --force_resume applies it. The number of processes may change: elastic.py, recorded.
LAUNCH_APPLIED = {
    "mixed_precision": "the compute precision of every later step, between no and bf16 (master weights and optimizer "
                       "state stay the checkpoint's fp32)",
    "fsdp.reshard_after_forward": "where gathered weights wait between forward and backward: the same arithmetic",
    "fsdp.activation_checkpointing": "the same gradients, recomputed",
}
LAUNCH_WHY = {
    "strategy": "a checkpoint is stored in its strategy's own format: resume under the launch config that wrote it",
    "mixed_precision": "DeepSpeed keeps its optimizer state by precision, and fp16's loss scale is state the other "
                       "precisions lack: resume with the precision that wrote it",
    "deepspeed": "the DeepSpeed engine and its saved state follow these keys: resume with the JSON that wrote it",
    "fsdp": "FSDP's saved state follows these settings: resume with the launch config that wrote it",
}
# DeepSpeed keys that do not change what is trained or how it is saved: buffering, overlap, logging; the batch
# layout (compared as the global batch) and gradient_clipping (--max_grad_norm, checked equal at start-up).
DEEPSPEED_NOT_COMPARED = (
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
    "steps_per_print", "wall_clock_breakdown", "checkpoint", "flops_profiler", "comms_logger", "tensorboard", "wandb",
    "csv_monitor", "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
    "zero_optimization.reduce_scatter", "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_partitions",
    "zero_optimization.allgather_bucket_size", "zero_optimization.round_robin_gradients",
    "zero_optimization.sub_group_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory")
FSDP_COMPARED = ("fsdp_version", "state_dict_type", "cpu_offload", "reshard_after_forward", "activation_checkpointing",
                 "cpu_ram_efficient_loading")


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"a.b": value} of a nested dict's leaves."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def launch_identity(accelerator, data_parallel: bool = False) -> dict:
    """What of the launch a checkpoint is bound to: the strategy's family (one process, DDP and nn.DataParallel store
    the same files), the mixed precision, DeepSpeed's training keys, FSDP's settings."""
    kind = accelerator.distributed_type.value
    family = {"DEEPSPEED": "deepspeed", "FSDP": "fsdp"}.get(kind, "replicated")
    launch = {"strategy": family, "mixed_precision": accelerator.mixed_precision}
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        keys = flatten(plugin.deepspeed_config)
        launch["strategy"] += f" zero-{plugin.zero_stage}"
        launch["deepspeed"] = {k: v for k, v in sorted(keys.items())
                               if not any(k == n or k.startswith(n + ".") for n in DEEPSPEED_NOT_COMPARED)}
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if family == "fsdp" and fsdp is not None:
        launch["fsdp"] = {name: short_value(getattr(fsdp, name, None)) for name in FSDP_COMPARED}
    return launch


def short_value(value):
    """A plugin setting as JSON keeps it: enums by name, offload policies as whether they offload."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "name"):
        return value.name
    return type(value).__name__


def launch_changes(saved: dict, now: dict) -> list["Change"]:
    """Each differing launch setting, refused or applicable (LAUNCH_APPLIED)."""
    before, after = flatten(saved), flatten(now)
    changes = []
    for key in sorted({*before, *after}, key=lambda k: (k.count("."), k)):
        if before.get(key) == after.get(key):
            continue
        applicable = key in LAUNCH_APPLIED and not (key == "mixed_precision" and (
            "fp16" in (before.get(key), after.get(key)) or after["strategy"].startswith("deepspeed")))
        refused = None if applicable else LAUNCH_WHY.get(key.split(".")[0], LAUNCH_WHY["strategy"])
        changes.append(Change(f"launch {key}", before.get(key, "-"), after.get(key, "-"), refused))
    if any(c.name == "launch strategy" for c in changes):  # its keys follow from it: one line says it
        changes = [c for c in changes if c.name in ("launch strategy", "launch mixed_precision")]
    return changes


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
    is_flag: bool = False  # a flag's change (--name), not a derived entry's

    def describe(self) -> str:
        if self.name == EVALUATION:  # before/after: {set name: {rows, sha256}}
            def one(d):
                return f"{d['rows']} rows {d['sha256'][:12]}" if d else "-"
            names = sorted(k for k in {*self.before, *self.after} if self.before.get(k) != self.after.get(k))
            return "evaluation " + "; ".join(f"{k} {one(self.before.get(k))} -> {one(self.after.get(k))}"
                                             for k in names)
        if self.name == "global_batch":  # before/after: the batch layouts (recipes/checkpoints/elastic.py)
            from recipes.checkpoints import elastic

            return (f"global batch {elastic.describe_layout(self.before)} -> {elastic.describe_layout(self.after)} "
                    f"(to keep {elastic.global_batch(self.before)} samples per step: --gradient_accumulation_steps "
                    f"{elastic.ideal_accumulation(self.before, self.after)})")
        flag = f"--{self.name}" if self.is_flag else self.name if self.name.startswith("launch ") \
            else self.name.replace("_", " ")
        return f"{flag} {short(self.before)} -> {short(self.after)}"


def short(value) -> str:
    """A value as the error line shows it; in a dict (files, data) each hash cut to 12 characters."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {str(v)[:12]}" for k, v in value.items()) + "}"
    return json.dumps(value)


@dataclass
class Contract:
    flags: dict  # each compared flag: its value
    layout: dict  # the global batch's split: per_device_train_batch_size, gradient_accumulation_steps, world_size
    model: dict
    tokenizer: dict
    data: dict
    evaluation: dict = field(default_factory=dict)  # the evaluation sets' fingerprints, by name
    launch: dict = field(default_factory=dict)  # launch_identity
    changes: list = field(default_factory=list)  # [{name, before, after, step}]: applied changes, oldest first
    rules: dict = field(default_factory=dict, repr=False)  # each compared flag's Rule (not recorded: config.py's)

    @classmethod
    def of(cls, cfg, data: dict, world: int, launch: Optional[dict] = None, eval_sets: Optional[dict] = None
           ) -> "Contract":
        """This run's contract (after the data are prepared: problem_type is resolved then). `data`: the training
        data's identity (data_identity, or a stream's shards); `eval_sets`: the tokenized evaluation sets by name;
        `launch`: launch_identity of the Accelerator."""
        from recipes.checkpoints import best_model
        from recipes.model import source

        loading = source.loading_kwargs(cfg)
        flags = {name: getattr(cfg, name) for name in compared(cfg)}
        flags["metric_for_best_model"] = best_model.best_metric(cfg)
        tokenizer = cfg.tokenizer_name or cfg.model_name_or_path
        return cls(flags=flags, model=folder_identity(cfg.model_name_or_path, is_model_file, loading),
                   tokenizer=folder_identity(tokenizer, lambda p: p.name in TOKENIZER_FILES, loading),
                   data=data,
                   evaluation={name: data_identity(ds) for name, ds in (eval_sets or {}).items()},
                   launch=launch or {}, rules=compared(cfg),
                   layout={"per_device_train_batch_size": cfg.per_device_train_batch_size,
                           "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "world_size": world})

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "rules"}

    def differences(self, saved: dict) -> list[Change]:
        """This run's differences from a checkpoint's recorded contract, flags first. A checkpoint written before
        the evaluation sets or the launch were recorded is not compared on them."""
        changes = [Change(name, saved["flags"].get(name), value, self.rules[name].why
                          if self.rules[name].kind == "refused" else None, is_flag=True)
                   for name, value in self.flags.items() if saved["flags"].get(name) != value]
        from recipes.checkpoints.elastic import global_batch

        if global_batch(saved["layout"]) != global_batch(self.layout):
            changes.append(Change("global_batch", saved["layout"], self.layout))
        for name, why in DERIVED.items():
            before, after = saved[name], getattr(self, name)
            stream = name == "data" and "shards" in before and "shards" in after
            if stream:  # a stream's shards, by hash: applied with --force_resume, from the checkpoint's position
                before, after = ({k: v["sha256"] for k, v in side["shards"].items()} for side in (before, after))
                why = None
            if before != after and (name != "data" or stream):  # the files that differ, each side ("-": not there)
                files = sorted(k for k in {*before, *after} if before.get(k) != after.get(k))
                before, after = ({k: str(side.get(k, "-")) for k in files} for side in (before, after))
            if before != after:
                changes.append(Change(name, before, after, why))
        if saved.get(EVALUATION) and saved[EVALUATION] != self.evaluation:
            changes.append(Change(EVALUATION, saved[EVALUATION], self.evaluation))
        if saved.get("launch") and self.launch:
            changes += launch_changes(saved["launch"], self.launch)
        return changes

    @property
    def restarts_best(self) -> set[str]:
        """Applied changes after which best/ and the patience count start again: the evaluations before the
        resume scored something else than the ones after it."""
        return {name for name, rule in self.rules.items() if rule.why == EVALUATIONS} | {EVALUATION}

    def settle(self, start, force: bool):
        """Compare with the checkpoint `start` resumes; a RecipeError for what may not change, else `start` with
        the changes to apply and this contract's history. A fresh start returns it as it is."""
        if start.path is None:
            return start
        if start.contract is None:  # a checkpoint written before contracts: its seed and batch were all it kept
            return start
        changes = self.differences(start.contract)
        self.changes = list(start.contract.get("changes", []))
        saved_world, world = start.contract["layout"]["world_size"], self.layout["world_size"]
        if saved_world != world:  # elastic: allowed at the same global batch, and recorded
            self.changes.append({"name": "world_size", "before": saved_world, "after": world, "step": start.step})
        if not changes:
            return start
        refused = [c for c in changes if c.refused]
        if refused:  # said first, with or without --force_resume: forcing would not help
            raise RecipeError(f"checkpoint {start.path}: --force_resume cannot apply "
                              + "; ".join(f"{c.describe()} ({c.refused})" for c in refused)
                              + ": start a new run (another --output_dir, or --overwrite_output_dir)")
        if not force:
            raise RecipeError(f"checkpoint {start.path} was written by another training: "
                              f"{'; '.join(c.describe() for c in changes)}. Resume with the same flags and files, or "
                              f"pass --force_resume to apply the changes from step {start.step} on")
        epoch = start.epoch + 1 if start.samples_in_epoch else start.epoch  # the first epoch a new order orders
        notes = {name: f"from epoch {epoch}" for name, rule in self.rules.items() if rule.why == ORDER}
        notes.update({name: "best/ and patience restart" for name in self.restarts_best})
        self.changes += [{"name": c.name, "before": c.before, "after": c.after, "step": start.step,
                          **({"note": notes[c.name]} if c.name in notes else {})} for c in changes]
        if os.environ.get("RANK", "0") == "0":
            print(f"--force_resume: from step {start.step} on, " + "; ".join(
                c.describe() + (f" ({notes[c.name]})" if c.name in notes else "") for c in changes))
        restarts = any(c.name in self.restarts_best for c in changes)
        return type(start)(**{**vars(start), "changes": changes, "best_restarts": restarts})


def apply_changes(changes: list, cfg, scheduler) -> None:
    """After the checkpoint is loaded: the forced changes that live in the optimizer and the schedule. The rate of
    each group becomes the new base times the (rebuilt) schedule's factor at the checkpoint's step, so the next step
    uses it; the schedule's base rates, which the checkpoint restored, become the new one. A new decay goes to the
    groups cls.param_groups marked as decayed. The others (clipping, order, length, patience) are read from the
    flags as the run goes."""
    from torch.optim.lr_scheduler import LambdaLR

    if not changes:
        return
    names = {c.name for c in changes}
    lr_scheduler = getattr(scheduler, "scheduler", scheduler)  # Accelerate's wrapper keeps torch's scheduler
    if not isinstance(lr_scheduler, LambdaLR):  # every schedule training/schedule.py builds is one
        raise RecipeError(f"--force_resume: a {type(lr_scheduler).__name__} schedule cannot take a new rate")
    # the stepping optimizer's groups: checkpoint.load_checkpoint pointed the schedule at them
    # (schedule_stepping_groups)
    groups = lr_scheduler.optimizer.param_groups
    if "weight_decay" in names:
        decayed = [g for g in groups if g.get("decayed")] or groups[:1]  # a checkpoint from before the mark
        for g in decayed:
            g["weight_decay"] = cfg.weight_decay
    lr_scheduler.base_lrs = [cfg.learning_rate for _ in lr_scheduler.base_lrs]
    rates = [base * factor(lr_scheduler.last_epoch) for base, factor in zip(lr_scheduler.base_lrs,
                                                                           lr_scheduler.lr_lambdas)]
    lr_scheduler._last_lr = rates  # what get_last_lr() reports: the rate the next step uses
    for g, rate in zip(groups, rates):
        g["initial_lr"] = cfg.learning_rate
        g["lr"] = rate


# How the table names each refused launch entry.
LAUNCH_SHOWN = {"strategy": "launch strategy (one process / DDP / nn.DataParallel alike; FSDP; DeepSpeed's ZeRO stage)",
                "mixed_precision": "launch mixed_precision under DeepSpeed, or to or from fp16",
                "deepspeed": "launch deepspeed.*: the JSON's keys but buffering, overlap, logging and the batch layout",
                "fsdp": f"launch fsdp.*: {', '.join(k for k in FSDP_COMPARED if 'fsdp.' + k not in LAUNCH_APPLIED)}"}


def markdown_table(config) -> str:
    """The whole contract as docs/checkpoints.md shows it (tests/test_docs.py holds the page to it): each compared
    flag of `config` (the Config dataclass) and each derived entry, what a change of it does, grouped where the
    reason is the same."""
    def rows(table: dict, verdict: str, name=lambda n: f"`--{n}`") -> list[str]:
        grouped: dict[str, list[str]] = {}
        for key, why in table.items():
            grouped.setdefault(why, []).append(name(key))
        return [f"| {', '.join(names)} | {verdict} | {why} |" for why, names in grouped.items()]

    by_kind = {kind: {n: r.why for n, r in rules(config).items() if r.kind == kind} for kind in ("refused", "applied")}
    lines = ["| what | a change on resume | why, or from when |", "|---|---|---|",
             *rows(by_kind["refused"], "refused"),
             "| model, tokenizer, training data: the SHA-256 of their files (a Hub model: its commit; the data: the "
             "tokenized rows) | refused | another model, tokenizer or data than the checkpoint trained |",
             *rows({**by_kind["applied"], EVALUATION: EVALUATIONS}, "applied",
                   lambda n: f"`--{n}`" if n != EVALUATION else "the evaluation sets' tokenized rows (SHA-256)"),
             "| global batch (per-device batch x accumulation x processes) | applied | the rest of the epoch dealt in "
             "the new batch from the checkpoint's sample position; the steps and schedule counted anew |",
             "| number of processes, at the same global batch | allowed, recorded | elastic resume (elastic.py) |",
             *rows({f"launch {k}": v for k, v in LAUNCH_APPLIED.items()}, "applied", lambda n: n),
             *rows({LAUNCH_SHOWN[k]: v for k, v in LAUNCH_WHY.items()}, "refused", lambda n: n)]
    return "\n".join(lines) + "\n"
