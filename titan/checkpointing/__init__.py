"""Checkpointing, one package: the manager (saves and loads the Stateful objects it is handed),
folders and atomic commit, manifest, lock, config diff, save failures, async staging, preemption,
preflight, in-memory snapshots (/dev/shm, ring copies, the restart's choice), and the model-weight
formats (model-only DCP folders, Hugging Face folders)."""
