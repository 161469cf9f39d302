"""What a user runs beside the recipe: config checker, memory model, sweeps, model staging, the GPU check, SLURM.
The measurement machinery (make bench, probes, records) is the subpackage scripts/measure/."""
