"""Fine-tune a sequence classifier (a RoBERTa-style encoder, any Hugging Face encoder) with Accelerate.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/cls.py \
        --model_name_or_path artifacts/tiny-roberta --output_dir runs/demo

The strategy (DDP, FSDP, DeepSpeed ZeRO-2/3, offload, bf16) comes from the launch config, never from this file.
`python recipes/cls.py --data_parallel` runs plain `nn.DataParallel` over the visible GPUs in one process.
`main` reads as set-up phases; `train` runs `train_step` over each epoch's micro-batches, and `end_of_step` does
what an optimizer step ends in: its record, the evaluation, checkpoint and preemption due then. What a run writes:
docs/checkpoints.md; the flags: recipes/config.py.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForSequenceClassification

from recipes import RecipeError, hooks
from recipes.checkpoints import best_model, checkpoint, contract, elastic, preemption
from recipes.checks import launch_checks
from recipes.inputs import data, problem, streaming, tasks
from recipes.model import (activation_checkpointing, adapters, compilation, decoders, kernels, memstats, padding_free,
                           source)
from recipes.outputs import calibration, predict, profiling, records, report, tracking
from recipes.training import accelerator as setup, micro_batch, optimizer_step, process, schedule
from recipes.workarounds import transformers as transformers_fixes
from recipes.config import Config, parse_config  # the flags, each documented (recipes/config.py)
from recipes.metrics import check_scores, compute_metrics, load_metrics
from recipes.testing.probe import Probe


def build_model(cfg: Config, names: list[str], pinned: dict | None = None):
    labels, hub = problem.hf_labels_config(cfg.problem_type, names), source.loading_kwargs(cfg)
    attention = kernels.model_attention(cfg)  # --attn_implementation; by default transformers' (sdpa where it can)
    dtype = source.model_dtype(cfg)  # --torch_dtype: fp32 master weights whatever the file's dtype
    if cfg.random_init:
        config = AutoConfig.from_pretrained(cfg.model_name_or_path, **labels, **hub)
        with kernels.attention_refused(cfg):
            return decoders.apply(cfg, padding_free.apply(cfg, AutoModelForSequenceClassification.from_config(
                config, trust_remote_code=cfg.trust_remote_code, dtype=config.dtype if dtype == "auto" else dtype,
                **attention)))  # --padding_free: per-sequence attention; decoders: pad id, last-token pooling
    with source.mismatched_sizes_refused(cfg), kernels.attention_refused(cfg):
        model = AutoModelForSequenceClassification.from_pretrained(
            cfg.model_name_or_path, **labels, **hub, **attention, dtype=dtype,
            ignore_mismatched_sizes=cfg.ignore_mismatched_sizes)
    model = decoders.apply(cfg, padding_free.apply(cfg, transformers_fixes.drop_unused_weight_renamings(model)))
    return adapters.apply(cfg, model, pinned)  # --use_peft: LoRA, the base frozen, its files pinned for the merge


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (weights of linear layers, embeddings), none on vectors (biases and the
    scales and shifts of every kind of norm), decided by each parameter's shape, whatever the encoder names it.
    DeepSpeed ZeRO-3 with zero3_init_flag builds the model partitioned (1-D local tensors): its ds_shape tells.
    `decayed` marks the group a --force_resume'd --weight_decay goes to (contract.apply_changes)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    groups = [{"params": [p for p, m in zip(params, matrix) if m], "weight_decay": weight_decay, "decayed": True},
              {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0, "decayed": False}]
    # an empty group (LoRA on a decoder without biases trains matrices only) would be dropped by DeepSpeed 0.19.8's
    # ZeRO-3 optimizer, and the schedule built on both groups then fails at its first step
    return [g for g in groups if g["params"]]


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


def evaluate(model, eval_dl, accelerator: Accelerator, metrics, problem_type: str = "single_label",
             threshold: float = 0.5, outputs: dict | None = None) -> dict:
    """The metrics of the problem type over the labelled validation rows, each counted once on any world size;
    `outputs`, when given, receives their gathered logits and labels (the evaluation report's input)."""
    model.eval()
    all_logits, references = [], []
    for batch in eval_dl:
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits
        logits, refs = accelerator.gather_for_metrics((logits.float(), labels))
        all_logits.append(logits.cpu())
        references.append(refs.cpu())
    logits, references = torch.cat(all_logits), torch.cat(references)
    keep = problem.scored(problem_type, references)
    predictions = problem.predictions(problem_type, logits[keep], threshold)
    loss = float(problem.loss_sum(problem_type, logits[keep], references[keep])) / max(1, int(keep.sum()))
    if outputs is not None:
        outputs.update(logits=logits[keep], references=references[keep])
    model.train()
    return {**compute_metrics(metrics, predictions, references[keep]), "loss": loss, "n_examples": int(keep.sum())}


def evaluate_all(cfg: Config, model, loaders: data.Loaders, accelerator: Accelerator, metrics,
                 outputs: dict | None = None) -> dict:
    """The main validation set's scores, then each further set's (MNLI's mismatched) under its prefix."""
    result = evaluate(model, loaders.eval, accelerator, metrics, cfg.problem_type, cfg.multi_label_threshold, outputs)
    for prefix, loader in loaders.extra_eval:
        scores = evaluate(model, loader, accelerator, metrics, cfg.problem_type, cfg.multi_label_threshold)
        result.update({f"{prefix}_{name}": value for name, value in scores.items()})
    return result


@dataclass
class Run:
    """What set-up hands the loop: the prepared objects, the run's helpers, and the instruments of its steps."""

    cfg: Config
    accelerator: Accelerator
    model: Any
    optimizer: Any
    scheduler: Any
    loaders: data.Loaders
    tokenizer: Any
    metrics: dict
    loss_fn: problem.TrainingLoss
    terms: contract.Contract  # the training a checkpoint binds a resume to
    best: best_model.BestModel  # best/ and early stopping
    guard: preemption.StepGuard  # a stop signal or a non-finite step, agreed by every rank at a flush
    kept: report.Kept = field(default_factory=report.Kept)  # the evaluation final/ will hold, for the report
    log: records.StepLog | None = None  # the per-step records, read from the device in blocks
    progress: Any = None
    profiler: profiling.StepProfiler | None = None  # --profile_steps
    compiled: compilation.CompileWatch | None = None  # --torch_compile: shapes, graphs, compile time
    overflow: optimizer_step.OverflowCheck | None = None  # fp16: was the step skipped (loss-scale overflow)?
    fitted: dict | None = None  # --auto_micro_batch's choice

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)


@dataclass
class TrainState:
    """The loop's progress, owned by `train`; `end_of_step` and a checkpoint read it."""

    step: int  # optimizer steps done
    skipped: int  # of them, skipped on an fp16 overflow
    epoch: int
    micro: int = 0  # the micro-batch of `epoch` that ended the last optimizer step
    last_eval: dict | None = None
    started: float = field(default_factory=time.perf_counter)


def scored(run: Run, step: int, epoch: int) -> tuple[dict, dict]:
    """The model's evaluation now: its record, and its gathered logits and labels (the report's input)."""
    seen = {"step": step}
    scores = evaluate_all(run.cfg, run.model, run.loaders, run.accelerator, run.metrics, seen)
    return {"step": step, "epoch": epoch, **scores}, seen


def evaluate_step(run: Run, state: TrainState, epoch: int) -> dict:
    """The evaluation after step `state.step`: a new best is kept as best/; the report's input, the trackers,
    eval.jsonl."""
    result, seen = scored(run, state.step, epoch)
    result.update(run.compiled.counts())
    best = run.best.after_eval(result)
    if best:
        checkpoint.save_weights(run.accelerator, run.model, run.tokenizer, run.out / "best", result)
    run.kept.record(seen, best)  # the evaluation final/ will hold
    run.accelerator.log({f"eval/{k}": v for k, v in result.items() if isinstance(v, float)}, step=state.step)
    if run.accelerator.is_main_process:
        records.append_jsonl(run.out / "eval.jsonl", result)
    state.last_eval = result
    return result


def save(run: Run, state: TrainState, end_of_epoch: bool, eval_pending: bool = False) -> str:
    """Checkpoint the step just taken (every rank saves its part); returns its name."""
    cfg = run.cfg
    saved = checkpoint.TrainerState(
        step=state.step, **run.loaders.position(state.epoch, state.micro, end_of_epoch),
        world_size=run.accelerator.num_processes, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        per_device_train_batch_size=cfg.per_device_train_batch_size, seed=cfg.seed,
        length_group=run.loaders.group_size, skipped_steps=state.skipped, long_run=run.best.state(),
        eval_pending=eval_pending, finished=state.step == run.loaders.plan.total_steps or run.best.stop_early,
        contract=run.terms.record())
    path = checkpoint.save_checkpoint(run.accelerator, run.out, saved, cfg.save_total_limit)
    run.guard.saved(path)
    return path.name


def train_step(run: Run, batch: dict, norm: float) -> torch.Tensor | None:
    """One micro-batch: forward and backward under `accelerator.accumulate`, the optimizer step at its window's end.
    `norm`: the window's samples (or weight sum) the loss is the mean over. Returns the pre-clip gradient norm when
    the optimizer stepped, else None."""
    accelerator, labels, grad_norm = run.accelerator, batch.pop("labels"), None
    with accelerator.accumulate(run.model):
        logits = run.model(**batch).logits
        loss_sum = run.loss_fn(logits, labels)
        accelerator.backward(loss_sum * loss_scale(run.cfg.gradient_accumulation_steps, accelerator.num_processes,
                                                   norm))
        run.log.add(loss_sum, batch)
        if accelerator.sync_gradients:
            grad_norm = optimizer_step.clip_gradients(accelerator, run.model, run.cfg.max_grad_norm)
            run.overflow.before_step()
        run.optimizer.step()
        run.optimizer.zero_grad()
    return grad_norm


def end_of_step(run: Run, state: TrainState, grad_norm, samples: int, weight_sum: float | None) -> bool:
    """After an optimizer step: the schedule, the step's record, then the evaluation, checkpoint and preemption due
    now. True when training ends here."""
    cfg, plan = run.cfg, run.loaders.plan
    lr = run.scheduler.get_last_lr()[0]  # the rate this step used
    if run.overflow.skipped():  # fp16 overflow: no update, so the schedule waits too
        state.skipped += 1
    else:
        run.scheduler.step()
    state.step += 1  # a skipped step still consumed its window of samples
    run.profiler.step(state.step)  # closes it before the logging, evaluation and saving that follow
    run.log.end_step({"step": state.step, "epoch": state.epoch, "lr": lr, "samples": samples,
                      "skipped_steps": state.skipped, "elapsed": time.perf_counter() - state.started,
                      **run.compiled.counts(), **({"weight_sum": weight_sum} if weight_sum is not None else {})},
                     grad_norm, run.guard.stop_vote())
    run.progress.update(1)
    end_of_epoch, last = run.loaders.ends_epoch(state.micro), state.step == plan.total_steps
    eval_due = bool(cfg.eval_steps and state.step % cfg.eval_steps == 0) or end_of_epoch or last
    save_due = checkpoint.checkpoint_due(cfg.checkpointing_steps, state.step, end_of_epoch, last)
    if eval_due or save_due:
        run.log.flush()  # records up to here; the ranks' common checks (preemption.py) run on what it reads
    if run.guard.preempted:  # a stop signal reached some rank: every rank saw it at the same flush
        run.guard.leave_preempted(run.accelerator, save(run, state, end_of_epoch, eval_pending=eval_due))
    if eval_due:
        evaluate_step(run, state, state.epoch)
    hooks.reached("step", state.step)
    if save_due or (run.best.stop_early and cfg.checkpointing_steps):  # a restart then knows the run has ended
        save(run, state, end_of_epoch)
    return last or run.best.stop_early


def train_epoch(run: Run, state: TrainState) -> bool:
    """The micro-batches of epoch `state.epoch` (the rest of a resumed one); True when training ends in it."""
    batches, first = run.loaders.batches(state.epoch, run.accelerator)
    hooks.reached("epoch", state.epoch, batches)
    for micro, batch in enumerate(batches, start=first):
        hooks.reached("batch", batch)
        run.profiler.batch(state.step)  # --profile_steps: opens a profiled step at its first micro-batch
        # the window's samples on all ranks, and with --class_weights their weight sum: the loss is their mean
        samples, weight_sum = run.loaders.window(state.epoch, micro, batch, run.cfg.gradient_accumulation_steps)
        grad_norm = train_step(run, batch, samples if weight_sum is None else weight_sum)
        if not run.accelerator.sync_gradients:
            continue
        state.micro = micro
        if end_of_step(run, state, grad_norm, samples, weight_sum):
            return True
    return False


def instruments(run: Run, start: checkpoint.ResumePoint) -> None:
    """The loop's instruments: the progress bar, the step records, the profiler, the compile counts, the fp16 check."""
    cfg, accelerator, total = run.cfg, run.accelerator, run.loaders.plan.total_steps
    run.progress = tqdm(total=total, initial=start.step, disable=not accelerator.is_local_main_process, desc="train")
    run.log = records.StepLog(accelerator, run.out / "metrics.jsonl", cfg.logging_steps, run.progress,
                              on_flush=run.guard.check_block, tail=bool(padding_free.row_multiple(cfg)))
    run.profiler = profiling.StepProfiler(cfg.profile_steps, run.out / "profile", accelerator.process_index, total)
    run.compiled = compilation.CompileWatch(cfg, accelerator, run.model)
    run.overflow = optimizer_step.OverflowCheck(accelerator, run.optimizer)


def train(run: Run, start: checkpoint.ResumePoint) -> dict:
    """Train from `start` to the plan's last step or an early stop; returns the last evaluation."""
    instruments(run, start)
    state = TrainState(step=start.step, skipped=start.skipped_steps, epoch=start.epoch)
    run.model.train()  # from_pretrained returns a model in eval mode
    if start.eval_pending:  # preempted where an evaluation was due: it is this step's, before any training
        evaluate_step(run, state, start.epoch if start.samples_in_epoch else start.epoch - 1)
    for epoch in range(start.epoch, run.loaders.plan.epochs if not run.best.stop_early else start.epoch):
        state.epoch = epoch
        if train_epoch(run, state):
            break
    if run.best.stop_early and state.step > start.step:
        run.accelerator.print(f"early stopping after step {state.step}: {run.best.bad_evals} evaluations without a "
                              f"better {run.best.metric}")
    run.log.flush()
    run.progress.close()
    run.profiler.finish()  # a run that stopped early, before the last profiled step
    if state.last_eval is None:  # resumed from a checkpoint of the last step: nothing was trained or evaluated
        state.last_eval, seen = scored(run, state.step, start.epoch)
        run.kept.record(seen, False)
    hooks.reached("trained", run.out, run.model, run.optimizer, run.accelerator.device)
    return state.last_eval


@dataclass
class Inputs:
    """A run's tokenizer, tokenized data and training loss."""

    tokenizer: Any
    train: Any
    eval: Any
    names: list[str]  # the label names, index = logit
    predict: Any  # --predict_file's or --do_predict's rows; None
    extra_eval: list  # (prefix, dataset) of further validation sets: MNLI's mismatched
    loss_fn: problem.TrainingLoss  # --class_weights, --label_smoothing_factor


def examples(inputs: Inputs) -> int | None:
    """The training examples; None for a stream (not counted: no pass over it)."""
    return None if isinstance(inputs.train, streaming.StreamData) else len(inputs.train)


def start_up(cfg: Config) -> tuple[Accelerator, checkpoint.ResumePoint]:
    """What needs no data: the trackers and the model source checked, the Accelerator, the checkpoint to resume from
    (read, never changed)."""
    tracking.check_startup(cfg)  # trackers installed, Hub token and Hub reachable: before any work
    source.check_model_source(cfg)  # before any process group: a bad model path fails alike on every rank
    accelerator = setup.make_accelerator(cfg)
    kernels.set_attention_backends(cfg, accelerator.device)  # CUDA: SDPA without cuDNN unless --sdpa_cudnn
    checkpoint.check_shared_output_dir(accelerator, Path(cfg.output_dir))
    return accelerator, checkpoint.find_checkpoint(cfg, accelerator.num_processes)


def prepare_data(cfg: Config, accelerator: Accelerator, with_ids: bool) -> Inputs:
    """The tokenizer, the tokenized splits and the loss; `with_ids`: training examples carry their index."""
    set_seed(cfg.seed)
    tokenizer = source.load_tokenizer(cfg)
    failure = None
    with data.cache_writers_first(cfg, accelerator):  # files/Hub: rank 0 writes the dataset cache, then the others
        try:  # raised after the context: rank 0 failing inside it would leave the others waiting at its barrier
            if cfg.streaming:  # the training rows read as the run goes: its shards, the validation set whole
                train_ds = streaming.prepare(cfg, tokenizer)
                eval_ds, names, predict_ds, extra_eval = train_ds.eval, train_ds.names, None, []
            else:
                train_ds, eval_ds, names = data.prepare_datasets(cfg, tokenizer, with_ids=with_ids)
                predict_ds = data.prepare_predict(cfg, tokenizer, names)
                extra_eval = data.prepare_eval_sets(cfg, tokenizer)  # MNLI's mismatched set
        except RecipeError as err:
            failure = err
    if failure:
        raise failure
    check_scores(cfg.problem_type, tasks.extra_scores(cfg), len(names))  # --metric_name fits the problem
    loss_fn = problem.TrainingLoss.of(cfg, names, None if cfg.streaming else train_ds)
    calibration.check(cfg)  # --calibrate: a single-label run that trains and evaluates
    return Inputs(tokenizer, train_ds, eval_ds, names, predict_ds, extra_eval, loss_fn)


def build(cfg: Config, accelerator: Accelerator, start: checkpoint.ResumePoint, inputs: Inputs
          ) -> tuple[Run, checkpoint.ResumePoint]:
    """The contract a resume is held to (the resume point as this run will use it), the model and the loaders."""
    identity = {"shards": inputs.train.identity} if cfg.streaming else contract.data_identity(inputs.train)
    terms = contract.Contract.of(cfg, identity, accelerator.num_processes, contract.launch_identity(accelerator),
                                 {"validation": inputs.eval, **dict(inputs.extra_eval)})  # what is trained
    start = terms.settle(start, cfg.force_resume)  # a resume trains what its checkpoint did, or says what changes
    best = best_model.BestModel(cfg, start)  # checks --metric_for_best_model
    model = build_model(cfg, inputs.names, terms.model)
    launch_checks.check_launch(cfg, model)
    activation_checkpointing.apply(model, cfg.gradient_checkpointing)
    fitted = micro_batch.fit(cfg, accelerator, model, start)  # --auto_micro_batch: sets micro x accumulation
    if cfg.streaming:
        weights = inputs.loss_fn.weights.tolist() if inputs.loss_fn.weights is not None and \
            cfg.problem_type == "single_label" else None
        loaders = streaming.build_loaders(cfg, inputs.train, inputs.tokenizer, accelerator.num_processes, start,
                                          with_ids=cfg.record_ranks, weights=weights)
    else:
        loaders = data.build_loaders(cfg, inputs.train, inputs.eval, inputs.tokenizer, accelerator.num_processes,
                                     resume=start, device_type=accelerator.device.type)
        loaders.sample_weights = inputs.loss_fn.sample_weights(inputs.train)
    loaders.extra_eval = [(prefix, data.eval_loader(cfg, ds, inputs.tokenizer)) for prefix, ds in inputs.extra_eval]
    run = Run(cfg, accelerator, model, None, None, loaders, inputs.tokenizer, {}, inputs.loss_fn, terms, best,
              preemption.StepGuard(start, Path(cfg.output_dir)), fitted=fitted)
    return run, start


def prepare(run: Run, start: checkpoint.ResumePoint) -> checkpoint.ResumePoint:
    """The optimizer and schedule, everything through `accelerator.prepare` for the launch's strategy, the metrics;
    returns the resume point (under ZeRO on another world size: its universal conversion)."""
    cfg, accelerator, loaders = run.cfg, run.accelerator, run.loaders
    model = setup.maybe_data_parallel(run.model, cfg, accelerator)
    # With a DeepSpeed offload config, Accelerate 1.15.0 replaces it by DeepSpeed's CPU Adam, in AdamW mode because it
    # is a torch AdamW (accelerate/utils/deepspeed.py map_pytorch_optim_to_deepspeed): the same decoupled decay.
    optimizer = kernels.build_adamw(param_groups(model, cfg.weight_decay), cfg.learning_rate, cfg.optim,
                                    accelerator.device)  # --optim: fused where torch has it for the device
    scheduler = schedule.build_scheduler(cfg, optimizer, loaders.plan.total_steps)
    setup.complete_plugins(accelerator, cfg, model)  # DeepSpeed's "auto" values, FSDP's wrapped classes
    start = elastic.prepare_universal(accelerator, start)  # ZeRO on another world size: universal checkpoint
    run.model, run.optimizer, loaders.train, run.scheduler = accelerator.prepare(model, optimizer, loaders.train,
                                                                                 scheduler)
    process.hold_until_exit(run.model)  # never freed when main returns: a DDP teardown deadlock (torch 2.13.0, gloo)
    setup.check_engine(accelerator, cfg, run.model)  # the engine steps, clips and computes as the flags say
    loaders.eval = accelerator.prepare(loaders.eval)
    loaders.extra_eval = [(prefix, accelerator.prepare(loader)) for prefix, loader in loaders.extra_eval]
    with accelerator.main_process_first():  # rank 0 copies the metric modules into evaluate's cache first
        run.metrics = load_metrics(cfg.problem_type, tasks.extra_scores(cfg))
    return start


def resume(run: Run, start: checkpoint.ResumePoint, inputs: Inputs) -> None:
    """The checkpoint loaded on every rank, and only then the output folder prepared and run_config.json written:
    a refused or failed resume changes no file of --output_dir."""
    cfg, accelerator = run.cfg, run.accelerator
    set_seed(cfg.seed, device_specific=True)  # per-rank dropout streams, identical whatever the strategy's init did
    if start.path:
        checkpoint.load_checkpoint(accelerator, run.optimizer, run.scheduler, start, cfg.seed)  # model, optimizer, RNGs
        kernels.apply_after_load(run.optimizer, cfg.optim, accelerator.device)  # --optim, not the checkpoint's choice
        contract.apply_changes(start.changes, cfg, run.scheduler)  # --force_resume: the new rate, decay
        accelerator.print(f"resumed from {start.path} at step {start.step}")
    elif cfg.resume_from_checkpoint == "auto":
        accelerator.print(f"--resume_from_checkpoint auto: no checkpoint in {run.out / 'checkpoints'}, starting fresh")
    if accelerator.is_main_process:
        checkpoint.prepare_output_dir(run.out, start, cfg.overwrite_output_dir, cfg.do_train)
        plain = accelerator.unwrap_model(run.model)
        resolved = {**records.describe_run(cfg, accelerator, run.loaders.plan.total_steps, examples(inputs),
                                           len(inputs.eval)),
                    "dtypes": {"model_file": source.file_dtype(cfg), **memstats.describe_dtypes(run.optimizer)},
                    "training_contract": run.terms.record(), "long_run": run.best.describe(),
                    **micro_batch.describe(run.fitted, accelerator),
                    "kernels": kernels.describe(plain, run.optimizer, accelerator.device),
                    **adapters.describe(plain)}  # --use_peft: "lora", its counts
        (run.out / "run_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    accelerator.wait_for_everyone()  # no rank writes into --output_dir before rank 0 has prepared it
    accelerator.init_trackers("cls", config=records.tracker_config(asdict(cfg)))
    doing = f"training {examples(inputs) or 'a stream of'} examples for {run.loaders.plan.total_steps} steps" \
        if cfg.do_train \
        else "evaluating"
    accelerator.print(f"{doing} on {accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
                      f"precision {accelerator.mixed_precision}")


def evaluate_only(run: Run) -> dict:
    """--do_train false: the model as loaded, evaluated once (unless --do_eval false)."""
    if not run.cfg.do_eval:
        run.kept.record(None, False)
        return {"step": 0, "epoch": 0}
    result, seen = scored(run, 0, 0)
    run.kept.record(seen, False)
    if run.accelerator.is_main_process:
        records.append_jsonl(run.out / "eval.jsonl", result)
    return result


def finish(run: Run, inputs: Inputs, result: dict) -> dict:
    """After training: final/, predictions, the evaluation report, calibration and the model card; returns the
    evaluation of the weights final/ holds."""
    cfg, accelerator, out = run.cfg, run.accelerator, run.out
    final = best_model.save_final(accelerator, run.model, run.tokenizer, out, result, cfg.load_best_model_at_end) \
        if cfg.do_train else result
    held, what = run.kept.held(final is not result)  # the evaluation of final/'s weights
    thresholds = calibration.label_thresholds(cfg, held, what, inputs.names, accelerator.unwrap_model(run.model).config)
    if inputs.predict is not None:  # multi-label: at the stored or --calibrate thresholds per label, if any
        predict.write_predictions(cfg, accelerator, run.model, inputs.predict, run.tokenizer, inputs.names,
                                  out / "predictions.jsonl", thresholds)
    written = (None, None)  # this run's report and calibration: what the model card says of them
    if accelerator.is_main_process:  # <output_dir>/eval_report/ (recipes/outputs/report.py), --calibrate into final/
        written = (report.write(cfg, out, held, what, inputs.names, say=accelerator.print) if cfg.eval_report else None,
                   calibration.calibrate(cfg, out, held, what, inputs.names, thresholds, say=accelerator.print))
    if cfg.do_train:
        result = final
        tracking.finish(cfg, accelerator, out, result, *written)  # final/README.md; the upload with --push_to_hub
    accelerator.end_training()
    scores = " ".join(f"{k} {v:.4f}" for k, v in result.items() if k in best_model.ACCEPTED[cfg.problem_type])
    accelerator.print(f"eval {scores} on {result.get('n_examples', 0)} examples after {result['step']} steps; "
                      + (f"model in {out / 'final'}" if cfg.do_train else "nothing trained, nothing saved"))
    return result


def main(cfg: Config) -> dict:
    preemption.install_signal_handlers()  # a stop signal from here on ends the run at a checkpoint
    with Probe.for_run(cfg).installed() as probe:  # for testing only: inert unless a test asks (testing/probe.py)
        accelerator, start = start_up(cfg)
        inputs = prepare_data(cfg, accelerator, with_ids=probe.wants_sample_ids)
        run, start = build(cfg, accelerator, start, inputs)
        finished = best_model.finished_before(start, run.loaders.plan.total_steps, run.out)
        if finished is not None:  # a relaunch of a completed run: nothing to train, nothing written
            accelerator.end_training()
            return finished
        start = prepare(run, start)
        resume(run, start, inputs)
        hooks.reached("started", run.model, accelerator)
        result = train(run, start) if cfg.do_train else evaluate_only(run)
        return finish(run, inputs, result)


if __name__ == "__main__":
    try:
        main(parse_config())
    except preemption.Preempted:  # a checkpoint of the step every rank stopped at, and checkpoints/PREEMPTED
        process.exit_process(preemption.PREEMPTED_EXIT)
    except (RecipeError, RuntimeError) as caught:
        err = process.explained(caught)  # a RecipeError, or a library error whose plain cause is known
        if err is None:
            raise
        if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank fails alike: one line per machine
            tqdm.write(f"error: {err}", file=sys.stderr)  # on a line of its own, below a progress bar left open
        else:  # the launcher stops every rank once one has ended: local rank 0 prints first
            time.sleep(2)
        process.exit_process(2)
    process.exit_process(0)  # not a plain return: see exit_process (a finished run could abort at interpreter exit)
