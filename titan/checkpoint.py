"""Public import path of the checkpoint manager; the implementation is the titan/checkpointing
package (manager, loading, manifest, lock, config diff, failure handling, staging)."""

from titan.checkpointing.manager import CheckpointManager
from titan.checkpointing.resume import RunStart, prepare_run

__all__ = ["CheckpointManager", "RunStart", "prepare_run"]
