"""The measurement machinery: make bench and its baselines, GPU probes, activation memory, run records."""
