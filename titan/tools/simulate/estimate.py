"""The analytic estimate (titan/training/memory.py) in the simulator's categories, for the column
beside the simulated bytes. The one place the simulator calls the estimator: where it does not
model a layout its reason is shown instead of numbers."""

from __future__ import annotations

from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.tools.simulate.memory import CATEGORIES

__all__ = ["estimate_categories"]


def estimate_categories(config: JobConfig, world_size: int) -> tuple[dict[str, int] | None, str]:
    """({category: bytes, "total": bytes}, "") or (None, why the estimator cannot say)."""
    from titan.training.memory import estimate_memory

    try:
        est = estimate_memory(config, world_size)
    except TitanError as e:
        return None, str(e)
    out = dict.fromkeys(CATEGORIES, 0)
    out["parameters"] = int(est.param_bytes)
    out["optimizer_state"] = int(est.optimizer_bytes)
    if est.peak_phase == "optimizer step":
        out["gradients"] = int(est.grad_bytes)
        out["optimizer_aux"] = int(est.optimizer_step_bytes)
    else:
        # The estimator measures activations, the loss and the gradients reached so far as one peak.
        out["communication"] = int(est.gathered_param_bytes)
        out["activations"] = int(est.activation_bytes)
    out["total"] = int(est.total_bytes)
    return out, ""
