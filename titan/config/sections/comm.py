"""[comm]: the Comm section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.errors import require


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Collective timeout while setting up (first step included: compile, loading)."""
    train_timeout_seconds: int = 100
    """Collective timeout from the second step on (a hang then fails fast)."""
    trace_buf_size: int = 20000
    """NCCL flight-recorder entries per rank (TORCH_FR_BUFFER_SIZE); 0 disables it.
    With > 0 a timeout dumps the recorder to save_traces_folder."""
    save_traces_folder: str = "comm_traces"
    """Flight-recorder dump folder, relative to job.dump_folder (files rank_<r>)."""

    def validate(self) -> None:
        for key in ("init_timeout_seconds", "train_timeout_seconds"):
            require(getattr(self, key) >= 1, f"comm.{key}", getattr(self, key), "an integer >= 1 (seconds)")
        require(self.trace_buf_size >= 0, "comm.trace_buf_size", self.trace_buf_size, "an integer >= 0 (0 disables)")
