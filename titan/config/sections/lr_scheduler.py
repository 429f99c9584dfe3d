"""[lr_scheduler]: the LRScheduler section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.config.choices import DecayType
from titan.errors import require


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup steps: step s (1-based) runs at s / warmup_steps of the peak lr."""
    total_steps: int | None = None
    """Steps the schedule is planned over (its decay ends there). None: training.steps. Set it to
    train the first part of a longer plan; past it the lr stays at min_lr."""
    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (WSD: warmup, stable, decay): round(steps x
    decay_ratio) steps. None: decay over all steps after warmup. The formulas (torchtitan's) are
    in docs/torchtitan.md."""
    decay_type: DecayType = "linear"
    """Shape of the decay: linear, sqrt or cosine."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak lr."""

    def validate(self) -> None:
        require(self.warmup_steps >= 0, "lr_scheduler.warmup_steps", self.warmup_steps, "an integer >= 0")
        require(
            0.0 <= self.min_lr_factor <= 1.0, "lr_scheduler.min_lr_factor", self.min_lr_factor, "a number in [0, 1]"
        )
        require(
            self.total_steps is None or self.total_steps >= 1,
            "lr_scheduler.total_steps",
            self.total_steps,
            "an integer >= 1, or unset",
        )
        require(
            self.decay_ratio is None or 0.0 <= self.decay_ratio <= 1.0,
            "lr_scheduler.decay_ratio",
            self.decay_ratio,
            "a number in [0, 1], or unset",
        )
