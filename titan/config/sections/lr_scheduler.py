"""[lr_scheduler]: the LRScheduler section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.config.choices import DecayType


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
