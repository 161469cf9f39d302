"""The run on its devices: the Accelerator and every strategy workaround (`strategy.py`), the largest micro-batch that
fits (`micro_batch.py`) and the learning-rate schedule (`schedule.py`)."""
