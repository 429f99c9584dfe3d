"""Checkpoint package: titan/checkpointing/manager.py (CheckpointManager, re-exported by
titan/checkpoint.py) with loading, folders and commit, manifest, lock, config diff, failure
handling, staging, state dicts, preemption."""
