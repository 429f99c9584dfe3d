"""[stability]: the Stability section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan.errors import require


@dataclass
class Stability:
    grad_norm_spike_window: int = 20
    """Log steps in the running average the grad norm is compared with (each brings the largest grad
    norm of the steps since the previous log step)."""
    grad_norm_spike_threshold: float = 4.0
    """Relative margin: a grad-norm spike is grad_norm > running average * (1 + this); 4.0 flags five
    times the running level (a healthy run's early steps reach about three times it)."""
    loss_spike_window: int = 20
    """Log steps in the running average the loss is compared with."""
    loss_spike_threshold: float = 0.5
    """Relative margin: a loss spike is loss > running average * (1 + this)."""

    def validate(self) -> None:
        for key in ("grad_norm_spike_window", "loss_spike_window"):
            require(getattr(self, key) >= 1, f"stability.{key}", getattr(self, key), "an integer >= 1")
        for key in ("grad_norm_spike_threshold", "loss_spike_threshold"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, f"stability.{key}", value, "a finite number >= 0")
