"""[profiling]: the Profiling section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.errors import require


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

    def validate(self) -> None:
        if not self.enable_profiling and not self.enable_memory_snapshot:
            return
        require(self.profile_freq >= 1, "profiling.profile_freq", self.profile_freq, "an integer >= 1")
        if not self.enable_profiling:
            return
        require(self.active_steps >= 1, "profiling.active_steps", self.active_steps, "an integer >= 1")
        require(self.warmup_steps >= 0, "profiling.warmup_steps", self.warmup_steps, "an integer >= 0")
        require(
            self.warmup_steps + self.active_steps <= self.profile_freq,
            "profiling.profile_freq",
            rule=f"must be >= profiling.warmup_steps + profiling.active_steps ({self.warmup_steps} +"
            f" {self.active_steps}), the steps of one trace; got profile_freq ({self.profile_freq})",
        )
