"""Fine-tune a RoBERTa-style encoder for sequence classification with Accelerate.

    accelerate launch --config_file accelerate_configs/ddp.yaml recipes/cls.py \
        --model_name_or_path artifacts/tiny-roberta --output_dir runs/demo

The strategy (DDP, FSDP, DeepSpeed ZeRO-2/3, offload, bf16) comes from the launch config, never from this file.
`python recipes/cls.py --data_parallel` runs plain `nn.DataParallel` over the visible GPUs in one process.
Output contract (in --output_dir): run_config.json, metrics.jsonl, eval.jsonl, tracker records (--report_to),
final/ with its model card (README.md), best/, checkpoints/ (with --checkpointing_steps or on a preemption: exit
status 3, see recipes/checkpoints/longrun.py). The flags are recipes/config.py's Config.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForSequenceClassification

from recipes import RecipeError
from recipes.checkpoints import checkpoint, contract, elastic, longrun
from recipes.checks import launch_checks
from recipes.inputs import data, problem, tasks
from recipes.model import activation_checkpointing, adapters, compilation, decoders, kernels, padding_free, source
from recipes.outputs import calibration, predict, profiling, records, report, tracking
from recipes.training import micro_batch, schedule, strategy
from recipes.config import Config, parse_config  # the flags, each documented (recipes/config.py)
from recipes.metrics import check_scores, compute_metrics, load_metrics
from recipes.testing.probe import Probe


def build_model(cfg: Config, names: list[str]):
    labels, hub = problem.hf_labels_config(cfg.problem_type, names), source.loading_kwargs(cfg)
    attention = kernels.model_attention(cfg)  # --attn_implementation; by default transformers' (sdpa where it can)
    if cfg.random_init:
        config = AutoConfig.from_pretrained(cfg.model_name_or_path, **labels, **hub)
        with kernels.attention_refused(cfg):
            return decoders.apply(cfg, padding_free.apply(cfg, AutoModelForSequenceClassification.from_config(
                config, trust_remote_code=cfg.trust_remote_code, **attention)))  # decoders: pad id, last-token pooling
    with source.mismatched_sizes_refused(cfg), kernels.attention_refused(cfg):
        model = AutoModelForSequenceClassification.from_pretrained(
            cfg.model_name_or_path, **labels, **hub, **attention, ignore_mismatched_sizes=cfg.ignore_mismatched_sizes)
    model = decoders.apply(cfg, padding_free.apply(cfg, strategy.drop_unused_weight_renamings(model)))
    return adapters.apply(cfg, model)  # --use_peft: LoRA, the base frozen


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices (weights of linear layers, embeddings), none on vectors (biases and the
    scales and shifts of every kind of norm), decided by each parameter's shape, whatever the encoder names it.
    DeepSpeed ZeRO-3 with zero3_init_flag builds the model partitioned (1-D local tensors): its ds_shape tells."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    groups = [{"params": [p for p, m in zip(params, matrix) if m], "weight_decay": weight_decay},
              {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0}]
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


def train(cfg: Config, accelerator: Accelerator, model, optimizer, scheduler, loaders: data.Loaders, metrics,
          start: checkpoint.ResumePoint, probe: Probe, run: longrun.LongRun, tokenizer,
          terms: contract.Contract, loss_fn: problem.TrainingLoss, kept: report.Kept) -> dict:
    out, world, accum = Path(cfg.output_dir), accelerator.num_processes, cfg.gradient_accumulation_steps
    plan = loaders.plan
    model.train()  # from_pretrained returns a model in eval mode
    step, skipped, last_eval, t0 = start.step, start.skipped_steps, None, time.perf_counter()
    progress = tqdm(total=plan.total_steps, initial=step, disable=not accelerator.is_local_main_process, desc="train")
    log = records.StepLog(accelerator, out / "metrics.jsonl", cfg.logging_steps, progress, on_flush=run.check_block,
                          tail=bool(padding_free.row_multiple(cfg)))
    profiler = profiling.StepProfiler(cfg.profile_steps, out / "profile", accelerator.process_index, plan.total_steps)
    compiled = compilation.CompileWatch(cfg, accelerator, model)  # --torch_compile: shapes, graphs, compile time
    overflow = strategy.OverflowCheck(accelerator, optimizer)  # fp16: was the step skipped (loss-scale overflow)?

    def evaluate_step(epoch: int) -> dict:  # the evaluation after `step`; a new best is kept as best/
        seen = {"step": step}
        result = {"step": step, "epoch": epoch, **evaluate_all(cfg, model, loaders, accelerator, metrics, seen),
                  **compiled.counts()}
        best = run.after_eval(result)
        if best:
            checkpoint.save_weights(accelerator, model, tokenizer, out / "best", result)
        kept.record(seen, best)  # the report's input: the evaluation final/ will hold
        accelerator.log({f"eval/{k}": v for k, v in result.items() if isinstance(v, float)}, step=step)
        if accelerator.is_main_process:
            records.append_jsonl(out / "eval.jsonl", result)
        return result

    def save(epoch: int, end_of_epoch: bool, micro: int, eval_pending: bool = False) -> str:
        path = checkpoint.save_checkpoint(accelerator, out, {
            "step": step, **loaders.position(epoch, micro, end_of_epoch), "world_size": world,
            "gradient_accumulation_steps": accum,
            "per_device_train_batch_size": cfg.per_device_train_batch_size, "seed": cfg.seed,
            "length_group": loaders.sampler.group_size, "skipped_steps": skipped, "long_run": run.state(),
            "eval_pending": eval_pending, "finished": step == plan.total_steps or run.stop_early,
            "contract": terms.record()}, probe, cfg.save_total_limit)
        run.saved(path)
        return path.name

    if start.eval_pending:  # preempted where an evaluation was due: it is this step's, before any training
        last_eval = evaluate_step(start.epoch if start.samples_in_epoch else start.epoch - 1)
    for epoch in range(start.epoch, plan.epochs if not run.stop_early else start.epoch):
        # Accelerate 1.15.0's prepared loader re-sets a single-process sampler's epoch to its own pass counter on each
        # iteration, a counter that starts at 0 in a resumed run: set the loader's epoch too, not only the sampler's.
        loaders.train.set_epoch(epoch)
        loaders.sampler.set_epoch(epoch)
        windows, weight_sums, batches = plan.windows(epoch), loaders.window_weights(epoch), loaders.train
        skip = loaders.consumed_batches(epoch)  # resumed mid-epoch: the micro-batches the checkpoint trained on
        if skip:
            batches = data.keep_loader_options(accelerator.skip_first_batches(loaders.train, skip), loaders.train)
        probe.epoch(epoch, batches)
        for micro, batch in enumerate(batches, start=skip):
            probe.batch(batch)
            profiler.batch(step)  # --profile_steps: opens a profiled step at its first micro-batch
            n_window = windows[micro // accum]
            norm = weight_sums[micro // accum] if weight_sums else n_window  # --class_weights: the window's weights
            labels = batch.pop("labels")
            with accelerator.accumulate(model):
                logits = model(**batch).logits
                loss_sum = loss_fn(logits, labels)
                accelerator.backward(loss_sum * loss_scale(accum, world, norm))
                log.add(loss_sum, batch)
                if accelerator.sync_gradients:
                    grad_norm = strategy.clip_gradients(accelerator, model, cfg.max_grad_norm)
                    overflow.before_step()
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            lr = scheduler.get_last_lr()[0]  # the rate this step used
            if overflow.skipped():  # fp16 overflow: no update, so the schedule waits too
                skipped += 1
            else:
                scheduler.step()
            step += 1  # a skipped step still consumed its window of samples
            profiler.step(step)  # closes it before the logging, evaluation and saving that follow
            log.end_step({"step": step, "epoch": epoch, "lr": lr, "samples": n_window, "skipped_steps": skipped,
                          "elapsed": time.perf_counter() - t0, **compiled.counts(),
                          **({"weight_sum": norm} if weight_sums else {})}, grad_norm, run.stop_vote())
            progress.update(1)
            end_of_epoch = micro + 1 == len(loaders.train)
            eval_due = (cfg.eval_steps and step % cfg.eval_steps == 0) or end_of_epoch or step == plan.total_steps
            save_due = checkpoint.checkpoint_due(cfg.checkpointing_steps, step, end_of_epoch, step == plan.total_steps)
            if eval_due or save_due:
                log.flush()  # records up to here; the ranks' common checks (longrun) run on what it reads
            if run.preempted:  # a stop signal reached some rank: every rank saw it at the same flush
                run.leave_preempted(accelerator, save(epoch, end_of_epoch, micro, eval_pending=bool(eval_due)))
            if eval_due:
                last_eval = evaluate_step(epoch)
            probe.step(step)
            if save_due or (run.stop_early and cfg.checkpointing_steps):  # a restart then knows the run has ended
                save(epoch, end_of_epoch, micro)
            if step == plan.total_steps or run.stop_early:
                break
        if run.stop_early:
            accelerator.print(f"early stopping after step {step}: {run.bad_evals} evaluations without a better "
                              f"{run.metric}")
            break
    log.flush()
    progress.close()
    profiler.finish()  # a run that stopped early, before the last profiled step
    if last_eval is None:  # resumed from a checkpoint of the last step, or after early stopping: nothing to train
        seen = {"step": step}
        last_eval = {"step": step, "epoch": start.epoch, **evaluate_all(cfg, model, loaders, accelerator, metrics,
                                                                         seen)}
        kept.record(seen, False)
    probe.finish(out, model, optimizer, accelerator.device)
    return last_eval


def main(cfg: Config) -> dict:
    longrun.install_signal_handlers()  # a stop signal from here on ends the run at a checkpoint (checkpoints/longrun.py)
    tracking.check_startup(cfg)  # trackers installed, Hub token and Hub reachable: before any work
    source.check_model_source(cfg)  # before any process group: a bad model path fails alike on every rank
    accelerator = strategy.make_accelerator(cfg)
    kernels.set_attention_backends(cfg, accelerator.device)  # CUDA: SDPA without cuDNN unless --sdpa_cudnn
    out = Path(cfg.output_dir)
    checkpoint.check_shared_output_dir(accelerator, out)
    start = checkpoint.find_checkpoint(cfg, accelerator.num_processes)
    probe = Probe.for_run(cfg, accelerator.process_index)
    set_seed(cfg.seed)
    tokenizer = source.load_tokenizer(cfg)
    failure = None
    with data.cache_writers_first(cfg, accelerator):  # files/Hub: rank 0 writes the dataset cache, then the others
        try:  # raised after the context: rank 0 failing inside it would leave the others waiting at its barrier
            train_ds, eval_ds, names = data.prepare_datasets(cfg, tokenizer, with_ids=probe.wants_sample_ids)
            predict_ds = data.prepare_predict(cfg, tokenizer, names)
            extra_eval = data.prepare_eval_sets(cfg, tokenizer)  # MNLI's mismatched set
        except RecipeError as err:
            failure = err
    if failure:
        raise failure
    check_scores(cfg.problem_type, tasks.extra_scores(cfg), len(names))  # --metric_name fits the problem
    loss_fn = problem.TrainingLoss.of(cfg, names, train_ds)  # --class_weights, --label_smoothing_factor
    calibration.check(cfg)  # --calibrate: a single-label run that trains and evaluates
    terms = contract.Contract.of(cfg, train_ds, accelerator.num_processes)  # flags, model, data: what is trained
    start = terms.settle(start, cfg.force_resume)  # a resume trains what its checkpoint did, or says what changes
    run = longrun.LongRun(cfg, start, out)  # checks --metric_for_best_model
    model = build_model(cfg, names)
    launch_checks.check_launch(cfg, model)
    activation_checkpointing.apply(model, cfg.gradient_checkpointing)
    fitted = micro_batch.fit(cfg, accelerator, model, start, probe)  # --auto_micro_batch: sets micro x accumulation
    loaders = data.build_loaders(cfg, train_ds, eval_ds, tokenizer, accelerator.num_processes, resume=start,
                                 device_type=accelerator.device.type)
    loaders.sample_weights = loss_fn.sample_weights(train_ds)
    total_steps = loaders.plan.total_steps
    finished = longrun.finished_before(start, total_steps, out)  # a relaunch of a completed run: nothing to do
    if finished is not None:
        accelerator.end_training()
        return finished
    model = strategy.maybe_data_parallel(model, cfg, accelerator)
    # With a DeepSpeed offload config, Accelerate 1.15.0 replaces it by DeepSpeed's CPU Adam, in AdamW mode because it
    # is a torch AdamW (accelerate/utils/deepspeed.py map_pytorch_optim_to_deepspeed): the same decoupled decay.
    optimizer = kernels.build_adamw(param_groups(model, cfg.weight_decay), cfg.learning_rate, cfg.optim,
                                    accelerator.device)  # --optim: fused where torch has it for the device
    scheduler = schedule.build_scheduler(cfg, optimizer, total_steps)

    strategy.complete_plugins(accelerator, cfg, model)  # DeepSpeed's "auto" values, FSDP's wrapped classes
    start = elastic.prepare_universal(accelerator, start)  # ZeRO on another world size: universal checkpoint
    model, optimizer, loaders.train, scheduler = accelerator.prepare(model, optimizer, loaders.train, scheduler)
    strategy.hold_until_exit(model)  # never freed when main returns: a DDP teardown deadlock (torch 2.13.0, gloo)
    strategy.check_engine(accelerator, cfg, model)  # the engine steps, clips and computes as the flags say
    loaders.eval = accelerator.prepare(loaders.eval)
    loaders.extra_eval = [(prefix, accelerator.prepare(data.eval_loader(cfg, ds, tokenizer)))
                          for prefix, ds in extra_eval]

    if accelerator.is_main_process:
        checkpoint.prepare_output_dir(out, start, cfg.overwrite_output_dir)
        resolved = {**records.describe_run(cfg, accelerator, total_steps, len(train_ds), len(eval_ds)),
                    "training_contract": terms.record(),
                    "long_run": run.describe(), **micro_batch.describe(fitted, accelerator),
                    "kernels": kernels.describe(accelerator.unwrap_model(model), optimizer, accelerator.device),
                    **adapters.describe(accelerator.unwrap_model(model))}  # --use_peft: "lora", its counts
        (out / "run_config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    accelerator.init_trackers("cls", config=records.tracker_config(asdict(cfg)))
    with accelerator.main_process_first():  # rank 0 copies the metric modules into evaluate's cache first
        metrics = load_metrics(cfg.problem_type, tasks.extra_scores(cfg))

    doing = f"training {len(train_ds)} examples for {total_steps} steps" if cfg.do_train else "evaluating"
    accelerator.print(f"{doing} on {accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
                      f"precision {accelerator.mixed_precision}")
    set_seed(cfg.seed, device_specific=True)  # per-rank dropout streams, identical whatever the strategy's init did
    if start.path:
        checkpoint.load_checkpoint(accelerator, optimizer, scheduler, start, cfg.seed)  # model, optimizer, RNGs
        kernels.apply_after_load(optimizer, cfg.optim, accelerator.device)  # --optim, not the checkpoint's choice
        contract.apply_changes(start.changes, cfg, scheduler)  # --force_resume: the new rate, decay
        accelerator.print(f"resumed from {start.path} at step {start.step}")
    elif cfg.resume_from_checkpoint == "auto":
        accelerator.print(f"--resume_from_checkpoint auto: no checkpoint in {out / 'checkpoints'}, starting fresh")
    probe.watch(model, accelerator)
    kept = report.Kept()  # the gathered logits and labels of the evaluation that final/ holds
    if cfg.do_train:
        result = train(cfg, accelerator, model, optimizer, scheduler, loaders, metrics, start, probe, run, tokenizer,
                       terms, loss_fn, kept)
    else:  # --do_train false: the model as loaded, evaluated once (without --do_eval false) and predicted
        seen = {"step": 0}
        result = {"step": 0, "epoch": 0, **(evaluate_all(cfg, model, loaders, accelerator, metrics, seen)
                                            if cfg.do_eval else {})}
        kept.record(seen if cfg.do_eval else None, False)
        if cfg.do_eval and accelerator.is_main_process:
            records.append_jsonl(out / "eval.jsonl", result)
    final = longrun.save_final(accelerator, model, tokenizer, out, result, cfg.load_best_model_at_end) \
        if cfg.do_train else result
    held, what = kept.held(final is not result)  # the evaluation of final/'s weights
    thresholds = calibration.label_thresholds(cfg, held, what, names, accelerator.unwrap_model(model).config)
    if predict_ds is not None:  # multi-label: at the stored or --calibrate thresholds per label, if any
        predict.write_predictions(cfg, accelerator, model, predict_ds, tokenizer, names, out / "predictions.jsonl",
                                  thresholds)
    if accelerator.is_main_process:  # <output_dir>/eval_report/ (recipes/outputs/report.py), --calibrate into final/
        if cfg.eval_report:
            report.write(cfg, out, held, what, names, say=accelerator.print)
        calibration.calibrate(cfg, out, held, what, names, thresholds, say=accelerator.print)
    if cfg.do_train:
        result = final
        tracking.finish(cfg, accelerator, out, result)  # final/README.md, and the upload with --push_to_hub
    accelerator.end_training()
    scores = " ".join(f"{k} {v:.4f}" for k, v in result.items() if k in longrun.ACCEPTED[cfg.problem_type])
    accelerator.print(f"eval {scores} on {result.get('n_examples', 0)} examples after {result['step']} steps; "
                      + (f"model in {out / 'final'}" if cfg.do_train else "nothing trained, nothing saved"))
    return result


if __name__ == "__main__":
    try:
        main(parse_config())
    except longrun.Preempted:  # a checkpoint of the step every rank stopped at, and checkpoints/PREEMPTED
        strategy.exit_process(longrun.PREEMPTED_EXIT)
    except (RecipeError, RuntimeError) as caught:
        err = strategy.explained(caught)  # a RecipeError, or a library error whose plain cause is known
        if err is None:
            raise
        if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank fails alike: one line per machine
            tqdm.write(f"error: {err}", file=sys.stderr)  # on a line of its own, below a progress bar left open
        else:  # the launcher stops every rank once one has ended: local rank 0 prints first
            time.sleep(2)
        strategy.exit_process(2)
    strategy.exit_process(0)  # not a plain return: see exit_process (a finished run could abort at interpreter exit)
