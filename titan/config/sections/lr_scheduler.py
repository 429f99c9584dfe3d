"""[lr_scheduler]: the LRScheduler section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from titan.config.choices import DecayType


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warmup steps from ~0 to the peak lr."""
    decay_ratio: float | None = None
    """Fraction of steps spent decaying at the end (WSD: warmup, stable, decay). None: decay over
    all steps after warmup."""
    decay_type: DecayType = "linear"
    """Shape of the decay: linear, sqrt or cosine."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak lr."""
