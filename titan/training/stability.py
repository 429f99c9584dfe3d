"""Training stability: non-finite policy, loss / grad-norm spike detection, parameter norm.

The Trainium seed recipe kept a 7B run on track by watching two signals every step: the grad
norm against its running average (absolute margin) and the loss against its running average
(relative margin). ``StabilityMonitor`` does both, counts spike *events* and how many steps each
lasted, and applies the ``training.nonfinite`` policy. It reads one scalar per step from the
device (the grad norm and loss must be on the host to decide whether to apply the update).
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist

from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.parallel.utils import global_l2_norm
from titan.log import logger

__all__ = ["SpikeDetector", "StabilityMonitor", "param_norm", "validate_stability_config"]


class SpikeDetector:
    """Spike: value > avg + margin (absolute) or value > avg * (1 + margin) (relative), where avg
    is the mean of the previous ``window`` finite values (spike steps included, so a lasting shift
    stops counting as a spike once the average catches up). Needs a full window before judging.

    ``events``: spikes counted once per run of consecutive spike steps; ``spike_steps``: all steps
    in a spike; ``longest``: longest run; ``durations``: length of every finished event.
    """

    def __init__(self, name: str, window: int, threshold: float, relative: bool) -> None:
        self.name = name
        self.threshold = threshold
        self.relative = relative
        self.history: deque[float] = deque(maxlen=window)
        self.events = 0
        self.spike_steps = 0
        self.longest = 0
        self.current = 0
        self.durations: list[int] = []

    def limit(self) -> float | None:
        if len(self.history) < (self.history.maxlen or 0):
            return None
        avg = sum(self.history) / len(self.history)
        return avg * (1.0 + self.threshold) if self.relative else avg + self.threshold

    def update(self, step: int, value: float) -> bool:
        """Feed one step's value; returns True when this step is (part of) a spike."""
        limit = self.limit()
        spike = limit is not None and value > limit
        if spike:
            if self.current == 0:
                self.events += 1
                logger.warning(f"{self.name} spike at step {step}: {value:.4g} > {limit:.4g} (running average"
                               f" {sum(self.history) / len(self.history):.4g} over {len(self.history)} steps)")
            self.current += 1
            self.spike_steps += 1
            self.longest = max(self.longest, self.current)
        elif self.current:
            self.durations.append(self.current)
            logger.warning(f"{self.name} spike ended at step {step} after {self.current} step(s)")
            self.current = 0
        self.history.append(value)
        return spike

    def scalars(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}_spikes": float(self.events),
            f"{prefix}_spike_steps": float(self.spike_steps),
            f"{prefix}_spike_longest": float(self.longest),
        }


class StabilityMonitor:
    """Per-step check for the trainer: ``check(step, loss, grad_norm)`` between clipping and the
    optimizer step; ``scalars()`` / ``console()`` for the metrics. ``values`` keeps the host copies
    read by the last check, so logging them costs no second sync."""

    def __init__(self, config: JobConfig) -> None:
        s, t = config.stability, config.training
        self.policy = t.nonfinite
        self.max_consecutive_skips = t.nonfinite_max_consecutive_skips
        self.grad_norm = SpikeDetector("grad-norm", s.grad_norm_spike_window, s.grad_norm_spike_threshold, relative=False)
        self.loss = SpikeDetector("loss", s.loss_spike_window, s.loss_spike_threshold, relative=True)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.values: dict[str, float] = {}

    def check(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, extra: dict[str, torch.Tensor] | None = None
    ) -> bool:
        """True: apply this step's update. False: skip it (skip_step). Raises TitanError to stop.
        Finite values feed the spike detectors (``grad_norm`` is the norm before clipping).

        ``loss`` and ``grad_norm`` must be the same on every rank (globally reduced), so all ranks
        take the same decision without another collective. ``extra`` scalars (e.g. param_norm on a
        log step) come to the host in the same single read and land in ``values`` too.
        """
        extra = extra or {}
        tensors = [loss, grad_norm, *extra.values()]
        read = torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()  # the one host sync
        self.values = dict(zip(("loss", "grad_norm", *extra), read))
        values = read[:2]
        bad = [(name, v) for name, v in zip(("loss", "grad_norm"), values) if not math.isfinite(v)]
        if not bad:
            self.consecutive_skips = 0
            self.loss.update(step, values[0])
            self.grad_norm.update(step, values[1])
            return True
        what = ", ".join(f"{name} = {v}" for name, v in bad)
        if self.policy == "stop":
            raise TitanError(f"non-finite {what} at step {step} (training.nonfinite = stop): stopping without"
                             " saving; restart from the last checkpoint, maybe with a lower lr or skip_step")
        self.skipped_steps += 1
        self.consecutive_skips += 1
        if self.consecutive_skips > self.max_consecutive_skips:
            raise TitanError(f"non-finite {what} at step {step}: {self.consecutive_skips} consecutive steps skipped,"
                             f" more than training.nonfinite_max_consecutive_skips = {self.max_consecutive_skips}")
        logger.warning(f"non-finite {what} at step {step}: optimizer step skipped"
                       f" ({self.skipped_steps} skipped so far, {self.consecutive_skips} in a row)")
        return False

    def scalars(self) -> dict[str, float]:
        return {
            **self.grad_norm.scalars("stability/grad_norm"),
            **self.loss.scalars("stability/loss"),
            "stability/skipped_steps": float(self.skipped_steps),
        }

    def console(self) -> dict[str, float]:
        """The counters worth a place on the console line, once any of them is non-zero."""
        if not (self.grad_norm.events or self.loss.events or self.skipped_steps):
            return {}
        return {
            "grad_spikes": float(self.grad_norm.events),
            "loss_spikes": float(self.loss.events),
            "skipped": float(self.skipped_steps),
        }


@torch.no_grad()
def param_norm(model_parts: list[torch.nn.Module], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Total L2 norm of all parameters: DTensor shards are combined (full_tensor of the norm), and
    with pipeline parallelism the per-stage norms are summed in square over ``pp_group``."""
    return global_l2_norm([p.detach() for m in model_parts for p in m.parameters()], pp_group)


def validate_stability_config(c: JobConfig) -> None:
    """[stability] and training.nonfinite_* (training.nonfinite is a Literal choice, checked by the loader)."""
    t, s = c.training, c.stability
    if t.nonfinite_max_consecutive_skips < 0:
        raise TitanError("config key 'training.nonfinite_max_consecutive_skips' must be >= 0,"
                         f" got {t.nonfinite_max_consecutive_skips}")
    for key in ("grad_norm_spike_window", "loss_spike_window"):
        if getattr(s, key) < 1:
            raise TitanError(f"config key 'stability.{key}' must be >= 1, got {getattr(s, key)}")
    for key in ("grad_norm_spike_threshold", "loss_spike_threshold"):
        value = getattr(s, key)
        if not (math.isfinite(value) and value >= 0):
            raise TitanError(f"config key 'stability.{key}' must be a finite number >= 0, got {value}")
