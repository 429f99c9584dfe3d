"""[job]: the Job section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.errors import require


@dataclass
class Job:
    config_file: str = ""
    """TOML file to load; CLI flags override its values. `--config_file` is accepted too."""
    dump_folder: str = "./outputs"
    """Root folder for everything a run writes (TensorBoard logs, checkpoints, traces)."""
    description: str = "titan training job"
    """Free-text description of the job, printed at start-up."""
    print_config: bool = False
    """Print the merged configuration (defaults <- TOML, with the files it extends <- CLI) at start-up."""
    print_config_sources: bool = False
    """Print the merged configuration as print_config does, each value followed by where it came
    from: the file and line that set it last, "command line", "environment" or "default"."""
    dry_run: bool = False
    """Check the layout without hardware: one CPU process on a fake process group builds the real
    mesh and the parallelized model on the meta device for `dry_run_world_size` ranks, then prints
    the plan and per-rank parameters and memory (scripts/simulate.py goes on to run a training step of
    one rank: run_train.sh's COMM_MODE=fake_backend)."""
    dry_run_world_size: int = 8
    """Number of ranks the dry run simulates (e.g. 512 for 64 nodes of 8 GPUs)."""
    debug: bool = False
    """Show the Python traceback of a titan error instead of its one-line message (so does the
    TITAN_DEBUG environment variable)."""
    overwrite: bool = False
    """Allow replacing checkpoints: start from scratch when the checkpoint folder holds an earlier
    run's checkpoints (they are deleted), or resume from an older checkpoint.load_step (the later
    ones are replaced). Without it titan resumes or stops with an error, never deletes."""

    def validate(self) -> None:
        require(self.dry_run_world_size >= 1, "job.dry_run_world_size", self.dry_run_world_size, "an integer >= 1")
