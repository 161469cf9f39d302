"""Predict the model-state bytes one rank holds under each strategy: parameters, gradients, optimizer state, buffers.

    python scripts/memory_model.py --model_name_or_path artifacts/roberta-large-shape --num_processes 8 --precision bf16
    python scripts/memory_model.py --num_params 355e6 --num_processes 8 --precision bf16

Prints GiB per rank for each strategy, like `accelerate estimate-memory` but for training state. Activations, the
CUDA context and the unsharded parameters FSDP / ZeRO-3 gather for one layer at a time are not included.

The ZeRO paper counts mixed-precision Adam as 16 bytes per parameter (2 bf16 weights + 2 bf16 grads + K=12: 4 fp32
master + 8 fp32 moments); fp32 Adam is 16 as well (4 + 4 + 8). What each library keeps is not always that split.
Every rule below was read in the source of the pinned versions (torch 2.13.0, accelerate 1.15.0, deepspeed 0.19.8)
and checked against recipes/model/memstats.py on CPU (scripts/measure/bench.py prints the ratio for every run):

DDP (Accelerate, also one process): parameters stay fp32 and bf16 is torch.autocast, which casts weights per op and
  frees the casts with the activations, so fp32 or bf16 hold the same 4 B params + 4 B grads + 8 B Adam. Gradients
  exist from backward to `zero_grad(set_to_none=True)`. DDP's reducer also keeps gradient buckets as large as the
  gradients (gradient_as_bucket_view=False) in C++, out of sight of memstats' garbage-collector walk, unless a
  TorchDispatchMode saw them (the bench's communication counter, recipes/testing/commstats.py): the Python tensor it
  made for the bucket then lives as long as the bucket (torch keeps a tensor's Python object once it has one).
DeepSpeed ZeRO-2 (DeepSpeedZeroOptimizer): the module is cast to the compute dtype (2 B in bf16, 4 B in fp32) and
  kept whole; the optimizer owns an fp32 clone of this rank's 1/N partition (made even when the model is fp32) and
  Adam's moments of it. Gradients are reduced in the compute dtype (grad_accum_dtype unset), so DeepSpeed keeps no
  full fp32 gradient: during the step a compute-dtype partition plus its fp32 copy exist and are freed after it.
  With contiguous_gradients it allocates (1 + overlap_comm) reduce buckets of reduce_bucket_size elements for
  backward and frees them after the reduction. offload_optimizer moves master, moments and a pinned fp32 gradient
  partition to the host for good, plus a compute-dtype staging copy of the partition and two staging buffers of the
  largest parameter's size (one on the host, one on the device).
DeepSpeed ZeRO-1 (DeepSpeedZeroOptimizer with partition_gradients=False): as ZeRO-2 between steps (whole
  compute-dtype module, fp32 master partition and its Adam moments) but the gradients are not partitioned: each
  rank holds the whole compute-dtype gradient from backward to the step. With "data_types": {"grad_accum_dtype":
  "fp32"} and bf16, DeepSpeed 0.19.8 (`_do_optimizer_sanity_check`) picks BF16_Optimizer at stage 1 instead, which
  keeps a flat fp32 gradient buffer as large as the model for the whole run, next to the sharded master and moments.
DeepSpeed ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): each parameter keeps a 1/N partition in the compute dtype;
  parameters of at most stage3_param_persistence_threshold elements also stay whole on every rank ("persistent").
  Others are gathered around their module's forward/backward and kept while they will be reused within
  stage3_max_reuse_distance elements, so after a forward-only pass (evaluation) they stay gathered until the next
  step; not a frozen input embedding (LoRA), whose module the recorded step never uses again after its forward, and
  not after a save, which gathers every parameter and partitions them all again. A gradient partition buffer in the
  compute dtype lives for the whole run, and so does one reduce bucket of reduce_bucket_size elements
  (contiguous_gradients). The fp32 gradient of the partition exists during the step,
  or for good on the host with offload_optimizer. offload_param moves the non-persistent partitions to the host.
FSDP2 (Accelerate's fully_shard): parameters stay sharded fp32 DTensors (4 B / N); bf16 is a
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) that gathers bf16 copies one unit at a time (the recipe
  sets reduce_dtype; Accelerate 1.15.0 would reduce in bf16). Gradients are reduce-scattered in fp32 and stored as
  sharded fp32 (4 B / N) until zero_grad; Adam's moments are sharded (8 B / N). Accelerate makes a unit of each
  fsdp_transformer_layer_cls_to_wrap layer and of the input embedding (both freed after forward) and leaves the rest
  (position embeddings, pooler, classifier) to the root unit, which torch keeps gathered from forward to the end of
  backward: after a forward-only pass (evaluation) it stays gathered until the next step. Dim-0 padding of each
  shard (< N rows) is ignored.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from recipes import RecipeError, first_line
from recipes.model import fsdp_wrap

REPO_ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "fsdp")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass
class ModelShape:
    num_params: int
    param_numels: Optional[list] = None  # elements of each parameter tensor, when known (ZeRO-3 persistence)
    fsdp_root_params: int = 0  # elements FSDP2's root unit holds: outside the wrapped layers and input embedding
    hidden_size: int = 0  # what Accelerate fills DeepSpeed's "auto" bucket and threshold sizes from
    num_layers: int = 0  # encoder layers: the attention term of the bench's model FLOPs
    trainable_params: Optional[int] = None  # with gradients and optimizer state (LoRA: adapters + head); None: all
    input_embedding_params: int = 0  # elements of the input embedding (ZeRO-3 releases it after forward when frozen)

    def persistent(self, threshold: int) -> int:
        """Elements in parameters that ZeRO-3 keeps whole (numel <= threshold); 0 when the shapes are unknown."""
        return sum(n for n in self.param_numels or [] if n <= threshold)

    def largest(self) -> int:
        return max(self.param_numels or [0])


@dataclass
class Part:
    name: str  # parameters, gradients, optimizer_state or buffers (the groups recipes/model/memstats.py reports)
    what: str  # one line saying which tensor this is
    nbytes: int
    where: str = "device"  # "device" (the accelerator, or the CPU when there is none) or "host" (offloaded)
    resident: bool = True  # kept between optimizer steps; False: only from backward to the end of the step
    visible: bool = True  # a Python tensor memstats can find; False: held in C++ (DDP's buckets)
    after_eval: bool = False  # not resident, but a forward-only pass leaves it allocated (ZeRO-3 gathers)


def auto_sizes(hidden: int) -> dict:
    """The zero_optimization sizes Accelerate 1.15.0 fills for "auto" from the model's hidden size
    (`Accelerator._prepare_deepspeed`, computed inline there: no function of its own to call)."""
    return {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


def fsdp_wrapped_layers(model) -> list:
    """The classes accelerate_configs/fsdp.yaml makes FSDP units of for `model`: those it names, else the recipe's
    choice from the model (recipes/model/fsdp_wrap.py)."""
    import yaml

    config = yaml.safe_load((REPO_ROOT / "accelerate_configs" / "fsdp.yaml").read_text())
    named = config["fsdp_config"].get("fsdp_transformer_layer_cls_to_wrap")
    return [c.strip() for c in named.split(",")] if named else fsdp_wrap.wrap_classes(model)[0]


def shape_from_model(name_or_path: str, num_labels: int = 2, lora_r: Optional[int] = None) -> ModelShape:
    """Parameter shapes of a sequence classifier, built on the meta device: no weights loaded, no memory used.
    With `lora_r`, the recipe's default LoRA (recipes/model/adapters.py) is applied to that skeleton: the parameters
    (adapters added, the head's trained copy included) and the trainable ones are counted from it."""
    from recipes.checks.launch_checks import model_skeleton

    model = model_skeleton(name_or_path, num_labels)
    if lora_r is not None:
        model = lora_skeleton(model, lora_r)
    config = model.config
    numels = [p.numel() for p in model.parameters()]
    wrapped = fsdp_wrapped_layers(model)
    units = [m for m in model.modules() if type(m).__name__ in wrapped]
    units.append(model.get_input_embeddings())
    in_units = {id(p) for unit in units for p in unit.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if lora_r is not None else None
    embedding = fsdp_wrap.input_embedding(model)
    return ModelShape(num_params=sum(numels), param_numels=numels, fsdp_root_params=root,
                      hidden_size=getattr(config, "hidden_size", 0), num_layers=getattr(config, "num_hidden_layers", 0),
                      trainable_params=trainable,
                      input_embedding_params=sum(p.numel() for p in embedding.parameters()) if embedding else 0)


def lora_skeleton(model, lora_r: int):
    """The recipe's --use_peft model of a meta-device skeleton (its defaults but --lora_r)."""
    from types import SimpleNamespace

    import torch

    from recipes.model import adapters

    flags = SimpleNamespace(use_peft=True, lora_r=lora_r, lora_alpha=adapters.LORA_DEFAULTS["lora_alpha"],
                            lora_dropout=0.0, lora_target_modules=None, model_name_or_path="", revision="main",
                            cache_dir=None, trust_remote_code=False, ignore_mismatched_sizes=False)
    with torch.device("meta"):
        return adapters.apply(flags, model)


def reduce_buckets(zero: dict, bucket_bytes: int) -> Part:
    """ZeRO-1/2's gradient reduce buckets around the step: two with overlap_comm (one fills while one reduces)."""
    n_buckets = 2 if zero.get("overlap_comm", False) else 1
    return Part("buffers", f"{n_buckets} reduce bucket(s)", n_buckets * bucket_bytes, resident=False)


def load_ds_config(strategy: str) -> dict:
    return json.loads((REPO_ROOT / "ds_configs" / f"{strategy}.json").read_text())


def predict(strategy: str, shape: ModelShape, world: int, precision: str, optimizer_states: int = 2,
            ds_config: Optional[dict] = None, comm_counted: bool = False) -> list[Part]:
    """The parts one rank holds. `ds_config` defaults to ds_configs/<strategy>.json for DeepSpeed strategies; its
    "bf16" switch is ignored in favour of `precision`, which is what the launch really used. `comm_counted`: the run
    counted its collectives with a dispatch mode, which makes DDP's C++ buckets visible to memstats."""
    P, N, b = shape.num_params, world, DTYPE_BYTES[precision]
    shard = math.ceil(P / N)
    T = shape.trainable_params or P  # what has gradients and optimizer state (LoRA: adapters + head)
    tshard = math.ceil(T / N)
    moments = 4 * optimizer_states  # fp32 state tensors per parameter: Adam's exp_avg and exp_avg_sq
    if strategy in ("single", "ddp"):
        parts = [Part("parameters", "fp32 parameters", 4 * P),
                 Part("gradients", "fp32 gradients", 4 * T, resident=False),
                 Part("optimizer_state", "optimizer moments", moments * T)]
        if N > 1:
            parts.append(Part("buffers", "DDP gradient buckets (C++)", 4 * T, visible=comm_counted))
        return parts
    if strategy == "fsdp":
        return [Part("parameters", "fp32 parameter shards", 4 * shard),
                Part("parameters", f"gathered {precision} root unit", b * shape.fsdp_root_params, resident=False,
                     after_eval=True),
                Part("gradients", "fp32 gradient shards", 4 * tshard, resident=False),
                Part("optimizer_state", "optimizer moments of the shard", moments * tshard)]
    if not strategy.startswith("zero"):
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")

    ds = ds_config or load_ds_config(strategy)
    zero = ds["zero_optimization"]

    # without the model, Accelerate's "auto" cannot be known: assume a hidden size of 1024
    auto = auto_sizes(shape.hidden_size or 1024)

    def size(key: str, default: float) -> int:
        """A size from the JSON; "auto" as Accelerate fills it from the model's hidden size."""
        value = zero.get(key, default)
        return auto.get(key, int(default)) if value == "auto" else int(float(value))

    opt_where = "host" if zero.get("offload_optimizer", {}).get("device", "none") != "none" else "device"
    bucket = size("reduce_bucket_size", 5e8) * b if zero.get("contiguous_gradients", True) else 0
    parts = [Part("optimizer_state", "fp32 master partition", 4 * tshard, opt_where),
             Part("optimizer_state", "optimizer moments of the partition", moments * tshard, opt_where)]
    if zero["stage"] == 1:
        parts.append(Part("parameters", f"{precision} parameters, whole", b * P))
        fp32_accum = ds.get("data_types", {}).get("grad_accum_dtype") == "fp32"
        if precision == "bf16" and fp32_accum and opt_where == "device":  # BF16_Optimizer
            parts.append(Part("gradients", "fp32 flat gradient buffer, whole (BF16_Optimizer)", 4 * T))
            return parts
        parts.append(Part("gradients", f"{precision} gradients, whole", b * T, resident=False))
        if b != 4:
            parts.append(Part("gradients", "fp32 copy of the gradient partition", 4 * tshard, resident=False))
        return parts + [reduce_buckets(zero, bucket)]
    if zero["stage"] == 2:
        parts.append(Part("parameters", f"{precision} parameters, whole", b * P))
        if opt_where == "host":
            largest = b * shape.largest()
            parts += [Part("gradients", "pinned fp32 gradient partition", 4 * tshard, "host"),
                      Part("buffers", f"{precision} staging copy of the partition", b * tshard, "host"),
                      Part("buffers", "gradient staging buffer (largest parameter)", largest, "host"),
                      Part("buffers", "gradient staging buffer (largest parameter)", largest)]
        else:
            parts.append(Part("gradients", f"{precision} gradient partition", b * tshard, resident=False))
            if b != 4:
                parts.append(Part("gradients", "fp32 copy of the gradient partition", 4 * tshard, resident=False))
        return parts + [reduce_buckets(zero, bucket)]
    if zero["stage"] != 3:
        raise ValueError(f"ZeRO stage {zero['stage']} is not modelled")
    persistent = shape.persistent(size("stage3_param_persistence_threshold", 1e5))
    param_where = "host" if zero.get("offload_param", {}).get("device", "none") != "none" else "device"
    # a frozen input embedding (LoRA) has no backward in the step's trace, so nothing reuses it: released after forward
    released = shape.input_embedding_params if T < P else 0
    gathered = min(P - persistent - released, size("stage3_max_live_parameters", 1e9))
    parts += [Part("parameters", f"persistent {precision} parameters, whole", b * persistent),
              Part("parameters", f"{precision} partitions of persistent parameters", b * math.ceil(persistent / N)),
              Part("parameters", f"{precision} partitions of the others", b * math.ceil((P - persistent) / N),
                   param_where),
              Part("parameters", f"gathered {precision} parameters", b * gathered, resident=False, after_eval=True),
              Part("gradients", f"{precision} gradient partition buffer", b * tshard, opt_where),
              Part("gradients", "fp32 gradient partition", 4 * tshard, opt_where, resident=opt_where == "host"),
              Part("buffers", "reduce bucket", bucket)]
    return parts


def totals(parts: list[Part]) -> dict:
    """Bytes per rank: `resident` between steps, `peak` with the parts that exist only around the step, on the
    device and on the host, and `after_eval`, what memstats can see after training and the final evaluation (the
    basis of the measured / predicted ratio), in total and per group."""
    def total(select):
        return sum(p.nbytes for p in parts if select(p))

    def after_eval(p: Part) -> bool:
        return p.visible and (p.resident or p.after_eval)

    out = {
        "resident": total(lambda p: p.resident),
        "peak": total(lambda p: True),
        "device_resident": total(lambda p: p.resident and p.where == "device"),
        "device_peak": total(lambda p: p.where == "device"),
        "host_resident": total(lambda p: p.resident and p.where == "host"),
        "after_eval": total(after_eval),
    }
    for name in ("parameters", "gradients", "optimizer_state", "buffers"):
        out[f"{name}_after_eval"] = total(lambda p: p.name == name and after_eval(p))
    return out


# Collectives of one optimizer step in the textbook (ZeRO paper, section 7): (kind, times, what is sent).
COMM_TERMS = {
    "ddp": [("all_reduce", 1, "gradients")],  # the gradients, once
    "zero1": [("reduce_scatter", 1, "gradients"), ("all_gather", 1, "parameters")],  # gradients to their partition,
    "zero2": [("reduce_scatter", 1, "gradients"), ("all_gather", 1, "parameters")],  # updated parameters back
    "zero3": [("all_gather", 2, "parameters"), ("reduce_scatter", 1, "gradients")],  # forward, backward; gradients
    "fsdp": [("all_gather", 2, "parameters"), ("reduce_scatter", 1, "gradients")],
}
# Strategies whose gradients travel in fp32 whatever the compute dtype: DDP keeps fp32 gradients under bf16 autocast;
# FSDP2 reduces in fp32 (recipes/workarounds/accelerate.py reduce_fsdp_gradients_in_fp32).
FP32_GRADIENTS = ("ddp", "fsdp")


def comm_bytes_per_step(strategy: str, shape: ModelShape, world: int, precision: str) -> dict:
    """The textbook bytes one rank sends per optimizer step, and their terms: ring all-reduce 2 x psi x (n-1)/n,
    all-gather and reduce-scatter psi x (n-1)/n, psi the bytes of what is sent (parameters in the compute dtype;
    gradients in fp32 for DDP and FSDP2, in the compute dtype for ZeRO). The factors are
    recipes/testing/commstats.py's (the measured side), so the two compare. ZeRO is checked in fp32 only: in bf16
    DeepSpeed's communication_data_type / grad_accum_dtype may send gradients in fp32. Offload changes where the
    optimizer runs, not what is communicated (measured: the same bytes). Single process (or n = 1): nothing."""
    from recipes.testing.commstats import ring_factor

    base = strategy.replace("_offload", "")
    if base not in COMM_TERMS or world <= 1:
        return {"total": 0.0, "terms": {}}
    psi = {"parameters": shape.num_params * DTYPE_BYTES[precision],
           "gradients": shape.num_params * (4 if base in FP32_GRADIENTS else DTYPE_BYTES[precision])}
    terms = {kind: times * psi[what] * ring_factor(kind, world) for kind, times, what in COMM_TERMS[base]}
    return {"total": sum(terms.values()), "terms": terms}


def format_table(shape: ModelShape, world: int, precision: str, strategies, optimizer_states: int = 2) -> str:
    header = (f"{shape.num_params:,} parameters, {world} process(es), {precision}, "
              f"{optimizer_states} fp32 optimizer state(s) per parameter; GiB per rank, model state only")
    columns = ("params", "grads", "optim", "buffers", "resident", "peak", "host")
    lines = [header, f"{'strategy':<14}" + "".join(f"{c:>10}" for c in columns)]
    for strategy in strategies:
        parts = predict(strategy, shape, 1 if strategy == "single" else world, precision, optimizer_states)
        t = totals(parts)
        device = {name: sum(p.nbytes for p in parts if p.name == name and p.where == "device")
                  for name in ("parameters", "gradients", "optimizer_state", "buffers")}
        row = list(device.values()) + [t["device_resident"], t["device_peak"], t["host_resident"]]
        lines.append(f"{strategy:<14}" + "".join(f"{v / GIB:>10.2f}" for v in row))
    lines.append("params..buffers: on the device at the step's peak; resident: kept between steps; "
                 "peak: device total around backward and step; host: offloaded, kept between steps.")
    if not shape.param_numels:
        lines.append("Parameter shapes unknown (--num_params): computed without ZeRO-3's persistent parameters, "
                     "ZeRO-2 offload's staging buffers and FSDP's gathered root unit; give --model_name_or_path.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model_name_or_path", help="model folder or Hub id: parameter shapes from its config")
    source.add_argument("--num_params", type=float, help="parameter count, e.g. 355e6")
    parser.add_argument("--num_labels", type=int, default=2, help="classes of the classification head")
    parser.add_argument("--num_processes", type=int, default=8, help="ranks that share the model state")
    parser.add_argument("--precision", choices=sorted(DTYPE_BYTES), default="bf16", help="compute dtype")
    parser.add_argument("--optimizer_states", type=int, default=2, help="fp32 states per parameter (Adam: 2)")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--lora_r", type=int, help="the recipe's --use_peft at this rank: gradients and optimizer "
                        "state of adapters + head only (needs --model_name_or_path)")
    args = parser.parse_args(argv)
    if args.model_name_or_path:
        try:
            shape = shape_from_model(args.model_name_or_path, args.num_labels, args.lora_r)
        except (RecipeError, OSError) as err:  # a Hub id it cannot fetch, a folder without config.json: one line
            raise SystemExit(f"error: {first_line(err)}") from None
    else:
        shape = ModelShape(num_params=int(args.num_params))
    print(format_table(shape, args.num_processes, args.precision, args.strategies, args.optimizer_states))


if __name__ == "__main__":
    main()
