"""Checkpoint helpers used by titan/checkpoint.py: folders and commit, state dicts, preemption."""
