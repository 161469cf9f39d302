"""Checkpoints and long runs: atomic save, find and exact resume (`checkpoint.py`), the training contract a resume is
held to (`contract.py`), resume on another world size (`elastic.py`), preemption and the non-finite guard
(`preemption.py`), the best model and early stopping (`best_model.py`)."""
