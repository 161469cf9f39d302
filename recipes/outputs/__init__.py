"""What a run writes: the jsonl records and run_config.json (`records.py`), trackers and the model card
(`tracking.py`), the evaluation report and calibration (`report.py`, `calibration.py`), predictions (`predict.py`)
and profiler traces (`profiling.py`)."""
