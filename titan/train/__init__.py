"""The training loop's parts, side by side: trainer, validator, metrics, stability, optimizer,
learning-rate schedule, loss, profiling, start-up report and determinism."""
