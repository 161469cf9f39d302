"""Build, once, the DeepSpeed C++ ops that the shipped configs load, before any training launch needs them.

DeepSpeed 0.19.8 compiles its ops on first use (torch's cpp_extension JIT, several minutes on 2 cores) inside the
first launch's `Accelerator(...)`, where it looks like a hang; a launch interrupted then leaves a lock that makes
every later DeepSpeed launch wait forever (recipes/workarounds/torch.py check_extension_locks). `make venv` runs this
script.

    python scripts/build_deepspeed_ops.py          # the ops of this machine's accelerator: CPU or CUDA

Built: the CPU Adam of the offload configs and, where DeepSpeed runs on the CPU accelerator, its shared-memory
collectives. Prints one line per op with the seconds it took (0 when already built).
"""
from __future__ import annotations

import time


def main() -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    names = ["CPUAdamBuilder"] + (["ShareMemCommBuilder"] if accelerator.device_name() == "cpu" else [])
    for name in names:
        start = time.perf_counter()
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible():
            print(f"{name}: not compatible with this machine, skipped")
            continue
        builder.load()
        print(f"{name}: built ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
