"""[comm]: the Comm section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Collective timeout while setting up (first step included: compile, loading)."""
    train_timeout_seconds: int = 100
    """Collective timeout from the second step on (a hang then fails fast)."""
    trace_buf_size: int = 20000
    """NCCL flight-recorder entries per rank (TORCH_NCCL_TRACE_BUFFER_SIZE); 0 disables it.
    With > 0 a timeout dumps the recorder to save_traces_folder."""
    save_traces_folder: str = "comm_traces"
    """Flight-recorder dump folder, relative to job.dump_folder (files rank_<r>)."""
