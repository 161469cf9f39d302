"""Activation memory with and without gradient checkpointing, measured on CPU as live tensor bytes.

    python scripts/measure/activation_memory.py --model_name_or_path artifacts/roberta-base-shape --batch_size 16 \
        --seq_len 128

Builds the classifier from the config (random init, no weights needed: artifacts/roberta-base-shape is the real
roberta-base shape, made offline by `make offline-model`), runs one training forward on a batch of random token ids
and reports the bytes of the tensors the forward created that are still alive when it returns: what autograd keeps
for backward (activations), the logits included. Tensors are counted once per storage (views share it) and followed
through a torch dispatch mode with weak references, so the number is exact for CPU tensors and independent of the
allocator. It also reports the peak of the same count during forward + backward (the parameter gradients, which
are the same with and without checkpointing, included). CPU and GPU keep the same tensors, so the saving carries
over; the CUDA context and the allocator's caching do not.
"""
from __future__ import annotations

import argparse
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MIB = 1024**2


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages of tensors created under this mode and still referenced; and their peak. A view of a
    tensor in `ignore` (the model's parameters) shares its storage and is not counted: autograd saves the transposed
    weight of every linear layer for backward, which is the weight, not an activation."""

    def __init__(self, ignore=()):
        super().__init__()
        self.live, self.peak, self.storages = 0, 0, {}  # storage key -> [bytes, live tensors on it]
        self.ignored = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in ignore}

    def _forget(self, key):
        entry = self.storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[key]

    def _track(self, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in self.ignored:
            return
        if key not in self.storages:
            self.storages[key] = [storage.nbytes(), 0]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.storages[key][1] += 1
        weakref.finalize(tensor, self._forget, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            self._track(tensor)
        return out


def build(model_name_or_path: str, checkpointing: bool, seed: int = 0, layers: int | None = None, **loading):
    """The classifier from its config, random init (no weights read), in train mode; a decoder classifier with the
    recipe's forward (recipes/model/decoders.py: last real token, no key-value cache). `layers`: cut to that many
    layers and to a vocabulary of at most CUT_VOCABULARY tokens (layer_scaled_activations)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from recipes.model import decoders

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_name_or_path, num_labels=2, **loading)
    if layers is not None:
        config = cut(config, layers)
    # fp32 as documented: transformers 5.23 builds a config's own dtype otherwise (Llama 3's bfloat16), and CPU bf16
    # matmuls keep weight copies alive for backward that would count as activations
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32,
                                                           trust_remote_code=loading.get("trust_remote_code", False))
    if decoders.is_decoder_classifier(model):
        model.__class__ = decoders.pooled_class(type(model))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


# A classifier's activations do not depend on the vocabulary (its head reads hidden states): the cut models keep at
# most this many tokens, so that a 128k-token embedding is not built to measure them.
CUT_VOCABULARY = 1024


def cut(config, layers: int):
    """`config` with `layers` layers (the first of a per-layer `layer_types` list) and a smaller vocabulary."""
    import copy

    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    config.vocab_size = min(config.vocab_size, CUT_VOCABULARY)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids beyond the cut (Llama 3's 128000) name nothing
        value = getattr(config, key, None)
        if isinstance(value, list):
            setattr(config, key, [i for i in value if i < config.vocab_size] or None)
        elif isinstance(value, int) and value >= config.vocab_size:
            setattr(config, key, None)
    return config


def measure_model(model, batch_size: int, seq_len: int, bf16: bool = False, seed: int = 0,
                  backward: bool = True) -> dict:
    """One training forward and backward of `model` on random ids: bytes alive after forward ('activations'), the
    peak over forward + backward (without `backward`: over forward), the loss. `bf16`: under CPU autocast to
    bfloat16, as a bf16 launch computes."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, model.config.vocab_size, (batch_size, seq_len), generator=gen)
    labels = torch.randint(0, 2, (batch_size,), generator=gen)
    model.zero_grad(set_to_none=True)
    mode = LiveTensorBytes(ignore=[*model.parameters(), *model.buffers()])
    with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        activations = mode.live
        if backward:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return {"activations": activations, "peak": mode.peak, "loss": loss.item()}


def measure(model_name_or_path: str, batch_size: int, seq_len: int, checkpointing: bool, seed: int = 0,
            bf16: bool = False) -> dict:
    """{'activations': bytes alive after forward, 'peak': peak bytes over forward + backward, 'loss': float}."""
    return measure_model(build(model_name_or_path, checkpointing, seed), batch_size, seq_len, bf16, seed)


def scaled_activations(model, batch_size: int, seq_len: int, bf16: bool = False) -> int:
    """`measure_model`'s activation bytes for `batch_size` without running it: measured at micro-batches of 1 and 2
    and extended along the line through them. Every activation (hidden states, attention scores, the FFN's) grows in
    proportion to the batch at a fixed length, so two points fix the line (equal to the measurement at the full batch
    to the byte here, with and without checkpointing); scripts/check_config.py prints it for a launch's batch. The
    peak over backward is not a line in the batch (0.85 of the measured one at batch 16 by this rule): not scaled."""
    one = measure_model(model, 1, seq_len, bf16, backward=False)["activations"]
    two = measure_model(model, 2, seq_len, bf16, backward=False)["activations"]
    return one + (batch_size - 1) * (two - one)


def layer_scaled_activations(model_name_or_path: str, batch_size: int, seq_len: int, checkpointing: bool,
                             **loading) -> int:
    """`scaled_activations` of the whole model without building it: for more than 2 layers, measured on its cuts to
    1 and 2 layers (`cut`: the vocabulary too) and extended along the line through them. Every layer of these
    classifiers keeps the same activations, so two points fix the line; a decoder LLM of 8B parameters then costs
    two cuts of a few hundred million on the CPU instead of 30 GB (tested on a 4-layer model against the whole)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_name_or_path, **loading)
    layers = getattr(config, "num_hidden_layers", 0)
    if layers <= 2:
        return scaled_activations(build(model_name_or_path, checkpointing, **loading), batch_size, seq_len)
    one, two = (scaled_activations(build(model_name_or_path, checkpointing, layers=n, **loading), batch_size, seq_len)
                for n in (1, 2))
    return one + (layers - 1) * (two - one)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", default="artifacts/roberta-base-shape")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--record", action="store_true", help="also write results/<date>_activation_memory_<device>_"
                        "<host>.json, the record the figures of docs/tutorials.md are checked against")
    args = parser.parse_args(argv)
    measured = {}
    for checkpointing in (False, True):
        r = measured["on" if checkpointing else "off"] = measure(args.model_name_or_path, args.batch_size,
                                                                 args.seq_len, checkpointing)
        print(f"{args.model_name_or_path} batch {args.batch_size} x {args.seq_len} tokens, gradient checkpointing "
              f"{'on ' if checkpointing else 'off'}: activations {r['activations'] / MIB:.1f} MiB, "
              f"peak forward+backward {r['peak'] / MIB:.1f} MiB, loss {r['loss']:.6f}")
    if args.record:
        import datetime as dt
        import json

        from recipes.outputs.records import library_versions
        from scripts.measure.bench import hardware
        from scripts.measure.run_record import results_path

        hw = hardware()
        path = results_path("activation_memory", hw)
        path.write_text(json.dumps({"date": str(dt.date.today()), "model": args.model_name_or_path,
                                    "batch_size": args.batch_size, "seq_len": args.seq_len, **measured,
                                    "hardware": hw, "versions": library_versions()}, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
