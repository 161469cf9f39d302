"""Activation memory with and without gradient checkpointing, measured on CPU as live tensor bytes.

    python scripts/activation_memory.py --model_name_or_path artifacts/roberta-base-shape --batch_size 16 --seq_len 128

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
    """Bytes of the storages of tensors created under this mode and still referenced; and their peak."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.storages = 0, 0, {}  # storage key -> [bytes, live tensors on it]

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


def measure(model_name_or_path: str, batch_size: int, seq_len: int, checkpointing: bool, seed: int = 0) -> dict:
    """{'activations': bytes alive after forward, 'peak': peak bytes over forward + backward, 'loss': float}."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_name_or_path, num_labels=2)
    model = AutoModelForSequenceClassification.from_config(config)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(5, config.vocab_size, (batch_size, seq_len))
    labels = torch.randint(0, 2, (batch_size,))
    mode = LiveTensorBytes()
    with mode:
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        activations = mode.live
        loss.backward()
    return {"activations": activations, "peak": mode.peak, "loss": loss.item()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", default="artifacts/roberta-base-shape")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=128)
    args = parser.parse_args(argv)
    for checkpointing in (False, True):
        r = measure(args.model_name_or_path, args.batch_size, args.seq_len, checkpointing)
        print(f"{args.model_name_or_path} batch {args.batch_size} x {args.seq_len} tokens, gradient checkpointing "
              f"{'on ' if checkpointing else 'off'}: activations {r['activations'] / MIB:.1f} MiB, "
              f"peak forward+backward {r['peak'] / MIB:.1f} MiB, loss {r['loss']:.6f}")


if __name__ == "__main__":
    main()
