"""torch.compile of the model (--torch_compile): who compiles it, which shapes it sees, how often and how long it
compiled.

Who: Accelerate. --torch_compile hands the Accelerator a TorchDynamoPlugin (accelerate 1.15.0), the object a launch
YAML's `dynamo_config` section also builds (through ACCELERATE_DYNAMO_*); without the flag a YAML's settings apply
unchanged. `accelerator.prepare` then compiles after wrapping, in the order each strategy needs: one process and DDP
compile the (DDP-wrapped) model last, dynamo's DDPOptimizer splitting the graph at the gradient buckets so that their
all-reduces still overlap the backward; FSDP2 compiles before `fully_shard`; DeepSpeed calls `DeepSpeedEngine.compile`
(deepspeed 0.19.8). Nothing is compiled by hand, so no strategy gets a compile in the wrong place. Under FSDP2 only
--compile_regions is accepted: Accelerate 1.15.0 compiles the whole model before `fully_shard`, whose hooks then
break the graph at every sharded layer; measured on CPU (tiny model, 2 ranks) 5 graphs at step 1 and 4 more at
step 2, and with dynamic shapes no first step within 4 minutes, against one compile of each layer's graph when the
layers are compiled on their own (torchtitan's per-block compile does the same).

What: the whole model (one graph through embeddings, every encoder layer and the classifier: the most fusion), or with
--compile_regions each repeated encoder layer on its own (Accelerate's regional compilation): the layers share one
compiled graph, so compiling costs about one layer instead of all of them, for the fusions across layer boundaries
that it gives up. The whole model is the default: on CPU the compile is paid once per shape and the fp32 step gains
only where fusion saves memory traffic; regional compilation is the choice where compile time matters (deep models,
short runs).

Shapes: dynamic padding gives each batch its own length, and the last batch of an epoch and the evaluation batches
another size. torch 2.13.0 compiles a first shape statically and recompiles on a new one, each graph costing tens of
seconds on CPU. So with dynamic padding the plugin asks for dynamic shapes (dynamic=True), and a forward pre-hook on
the prepared model (it runs before the compiled code) marks the batch and length dims of the token tensors
(`torch._dynamo.maybe_mark_dynamic`); with --pad_to_max_length it marks the batch only, and the length stays static,
which is what the fastest kernels want. Both are needed: the mark alone left regional compilation recompiling each
encoder layer at every new length (its layers see hidden states, not the marked inputs: measured +2 graphs per new
length). The training forward then compiles once and the evaluation forward (no_grad, eval mode: other guards) once:
2 graphs per shape policy for the whole model, whatever the lengths (with --compile_regions, one per region each: 3
and 3 on one process, 4 and 4 under FSDP2, measured on the tiny model). A batch of one example specialises its dim
(torch treats sizes 0 and 1 apart) and adds a graph. `torch._dynamo.config.recompile_limit` (8) is left as it is: a
run that passed it would fall back to eager for that code with a warning, and the graph count shows it.

Random numbers (--torch_compile_rng): by default, on CPU a compiled model's dropout draws its masks from torch's
generator, as the eager model does (inductor's `fallback_random`); on GPUs inductor's own generator stays (Philox, fused
into the kernels; no GPU figure here says otherwise). `torch` or `inductor` chooses either on any device. Measured by
`make bench BENCH=compile` on 2 CPU cores with the models' dropout 0.1 (results/2026-11-27_compile_cpu_vm.md), compiled
/ eager speed with torch's generator against inductor's, in two runs: tiny model 1.155 against 0.977 and 0.948 against
0.901, roberta-base shape 0.937 against 0.884 and 0.977 against 0.909 (docs/speed.md); with torch's generator the
per-step losses stay within 1e-6 of eager's (the same masks), with inductor's they leave them from step 1 (3.5e-2 and
1.6e-1 relative at most). Accelerate 1.15.0's TorchDynamoPlugin always passes a mode to torch.compile, and torch 2.13.0
refuses a mode with `options`, so the setting is inductor's process-wide config, set before the first compiled call (the
compile is lazy); `describe` records it in run_config.json.

Saving: Accelerate 1.15.0's `get_state_dict` names the weights of a compiled model `_orig_mod.<name>`;
`uncompiled_names` gives final/ and best/ the plain model's names.

Counts: `graphs` is dynamo's count of graphs compiled in this process (each training graph with its backward), and
`compile_s` the seconds dynamo and inductor spent compiling forwards and backwards (`calculate_time_spent`), both
cumulative, in every metrics.jsonl and eval.jsonl record of a compiled run (rank 0's): a step's `elapsed` includes
compile time, so a throughput leaves out the steps whose `graphs` grew (scripts/bench_compile.py does).
"""
from __future__ import annotations

import os

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's modes
RNG = ("auto", "torch", "inductor")  # --torch_compile_rng
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


def flag_problems(cfg) -> list[str]:
    problems = []
    if cfg.torch_compile_mode not in MODES:
        problems.append(f"unknown --torch_compile_mode '{cfg.torch_compile_mode}' (one of {', '.join(MODES)})")
    elif not cfg.torch_compile and (cfg.torch_compile_mode != "default" or cfg.compile_regions):
        problems.append("--torch_compile_mode and --compile_regions go with --torch_compile")
    if cfg.torch_compile_rng not in RNG:
        problems.append(f"unknown --torch_compile_rng '{cfg.torch_compile_rng}' (one of {', '.join(RNG)})")
    elif not cfg.torch_compile and cfg.torch_compile_rng != "auto":
        problems.append("--torch_compile_rng goes with --torch_compile")
    if cfg.torch_compile and not cfg.compile_regions and os.environ.get("ACCELERATE_USE_FSDP", "false") == "true":
        problems.append("--torch_compile under FSDP needs --compile_regions: the whole model compiled before "
                        "fully_shard breaks its graph at every sharded layer (accelerate 1.15.0, torch 2.13.0)")
    if cfg.torch_compile and cfg.data_parallel:
        problems.append("--torch_compile with --data_parallel: nn.DataParallel's replicas are not compiled; launch "
                        "DDP instead (accelerate_configs/ddp.yaml)")
    return problems


def dynamo_plugin(cfg):
    """The plugin of --torch_compile, or None: Accelerate then builds one from the launch config (no compile unless
    its YAML asks for one)."""
    if not cfg.torch_compile:
        return None
    from accelerate.utils import TorchDynamoPlugin

    return TorchDynamoPlugin(backend="inductor", mode=cfg.torch_compile_mode, dynamic=dynamic_lengths(cfg) or None,
                             use_regional_compilation=cfg.compile_regions)


def compiles(accelerator) -> bool:
    plugin = accelerator.state.dynamo_plugin
    return plugin is not None and plugin.backend.value.lower() != "no"


def dynamic_lengths(cfg) -> bool:
    return not cfg.pad_to_max_length


def dynamic_dims(cfg) -> tuple[int, ...]:
    """The input dims that vary between calls: the batch, and the length unless every batch is padded to one."""
    return (0, 1) if dynamic_lengths(cfg) else (0,)


def describe(cfg, accelerator) -> dict | None:
    """What is compiled, for run_config.json (None: nothing)."""
    if not compiles(accelerator):
        return None
    plugin = accelerator.state.dynamo_plugin
    return {"backend": plugin.backend.value.lower(), "mode": plugin.mode, "source": "--torch_compile" if
            cfg.torch_compile else "launch config", "regions": "encoder layers" if plugin.use_regional_compilation
            else "whole model", "dynamic_dims": ["batch", "length"][:len(dynamic_dims(cfg))],
            "by": "DeepSpeedEngine.compile" if accelerator.state.deepspeed_plugin else "accelerator.prepare",
            "random": "torch's generator (inductor fallback_random)" if generator_random(cfg, accelerator)
            else "inductor's generator"}


def generator_random(cfg, accelerator) -> bool:
    """Whether compiled dropout draws from torch's generator: --torch_compile_rng torch, or auto on CPU."""
    return cfg.torch_compile_rng == "torch" or (cfg.torch_compile_rng == "auto" and accelerator.device.type == "cpu")


class CompileWatch:
    """Marks the varying input dims before each forward of a compiled model and reads the compile counters; does
    nothing for a model that is not compiled (counts() is then empty, and the records keep their keys)."""

    def __init__(self, cfg, accelerator, model):
        self.active = compiles(accelerator)
        if self.active:
            import torch._inductor.config

            # read when the first call compiles; set either way (a process could have set it before)
            torch._inductor.config.fallback_random = generator_random(cfg, accelerator)
            dims = dynamic_dims(cfg)
            model.register_forward_pre_hook(lambda module, args, kwargs: mark_dynamic(kwargs, dims), with_kwargs=True)

    def counts(self) -> dict:
        if not self.active:
            return {}
        from torch._dynamo.utils import calculate_time_spent, counters

        return {"graphs": int(counters["stats"]["unique_graphs"]),
                "compile_s": round(calculate_time_spent()["total_wall_time"], 3)}


def mark_dynamic(inputs: dict, dims: tuple[int, ...]) -> None:
    """Before dynamo sees the call (a pre-hook of the prepared model runs before its compiled code, whatever wraps
    it): `dims` of the model's token tensors may vary."""
    import torch

    for name in MODEL_INPUTS:
        tensor = inputs.get(name)
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(tensor, list(dims))
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):  # --padding_free: the number of sequences
        if isinstance(inputs.get(name), torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(inputs[name], 0)


def uncompiled_names(state_dict: dict | None) -> dict | None:
    """The state dict of a compiled model under the plain model's names, for a folder `from_pretrained` loads.

    Accelerate 1.15.0's `get_state_dict` takes the state dict of `unwrap_model(model)`, which keeps the compiled
    wrapper (keep_torch_compile=True), so every name came out as `_orig_mod.<name>` (and `layer.0._orig_mod.<name>`
    for regions torch.compile wrapped one by one): final/ then loaded as a freshly initialised model. None (what a
    rank that gathers nothing gets under ZeRO-3) stays None.
    """
    if state_dict is None:
        return None
    return {key.replace("_orig_mod.", ""): value for key, value in state_dict.items()}
