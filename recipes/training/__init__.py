"""The run on its devices: the Accelerator of a launch config and what it must agree on (`accelerator.py`), the
optimizer step's gradient norm and fp16 skips (`optimizer_step.py`), the largest micro-batch that fits
(`micro_batch.py`), the learning-rate schedule (`schedule.py`), and how a process ends (`process.py`)."""
