"""[profiling]: the Profiling section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (CPU + CUDA activity), one trace per rank."""
    profile_freq: int = 10
    """Capture a trace every N steps (the last `active_steps` steps of each window)."""
    warmup_steps: int = 3
    """Profiler warm-up steps before the active steps of each window (not recorded)."""
    active_steps: int = 1
    """Steps recorded per trace."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder: iteration_<step>/rank<r>_trace.json."""
    enable_memory_snapshot: bool = False
    """CUDA only: record allocator history and dump a snapshot every profile_freq steps and on
    out-of-memory (view at pytorch.org/memory_viz)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder, relative to job.dump_folder."""
