"""For testing only, inert by default: what the tests and the benchmark observe inside a run, kept apart from what a
run needs. `probe.py` (the `Probe` the training loop calls at its four points, doing nothing unless --record_ranks
or CLS_FAULT asks) and `commstats.py` (the collective counter the probe turns on with CLS_COMM=1). The recipe touches
this package through that one object."""
