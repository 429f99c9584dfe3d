"""The analytic estimate (titan/training/memory) beside the simulated bytes: the one place the
simulator calls the estimator. Where it does not model a setting its reason is shown instead."""

from __future__ import annotations

from titan.config.job_config import JobConfig
from titan.errors import TitanError

__all__ = ["estimate_categories"]


def estimate_categories(config: JobConfig, world_size: int) -> tuple[dict[str, int] | None, str]:
    """({category: bytes, "total": bytes} at the rank's estimated peak, "") or (None, why the
    estimator cannot say)."""
    from titan.training.memory import estimate_memory

    try:
        est = estimate_memory(config, world_size)
    except TitanError as e:
        return None, str(e)
    return dict(est.categories), ""
