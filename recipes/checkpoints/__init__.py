"""Checkpoints and long runs: atomic save, find and exact resume (`checkpoint.py`), the training contract a resume is
held to (`contract.py`), resume on another world size (`elastic.py`), and restarts, preemption, the best model and
early stopping (`longrun.py`)."""
