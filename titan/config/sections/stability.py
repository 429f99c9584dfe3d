"""[stability]: the Stability section of the config tree (assembled in titan/config/job_config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stability:
    grad_norm_spike_window: int = 20
    """Steps in the running average the grad norm is compared with."""
    grad_norm_spike_threshold: float = 0.1
    """Absolute margin: a grad-norm spike is grad_norm > running average + this."""
    loss_spike_window: int = 20
    """Steps in the running average the loss is compared with."""
    loss_spike_threshold: float = 0.1
    """Relative margin: a loss spike is loss > running average * (1 + this)."""
