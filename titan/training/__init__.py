"""The training loop's parts, side by side: trainer, its build steps (shared with the dry run),
validator, metrics, stability, optimizer, learning-rate schedule, loss, garbage collection,
profiling, start-up report and determinism."""
