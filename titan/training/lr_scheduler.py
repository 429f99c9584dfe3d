"""Learning-rate schedules: linear warmup, stable phase (WSD), then decay to min_lr.

The formulas are torchtitan's (v0.2.2, ``linear_warmup_stable_decay``), so a config trains on the
same lr at every step in either library. ``lr_factor(s)`` is the factor used by optimizer step
``s + 1`` (``s`` = scheduler steps taken so far; LambdaLR evaluates s = 0 at construction). With
N = lr_scheduler.total_steps (unset: training.steps), W = warmup, D = decay steps and
S = N + 1 - W - D stable steps (one virtual step more than N - W - D, so the last planned step
does not run at exactly min_lr):

- warmup   s in [0, W):        (s + 1) / W             -- the first step already has lr > 0
- stable   s in [W, W + S):    1.0
- decay    s >= W + S:         p = (s + 1 - W - S) / D, capped at 1; the last planned step
                               (s = N - 1) has p = (D - 1) / D; factor = m + (1 - m) * shape(p)
                               with shape linear 1 - p, sqrt 1 - sqrt(p), cosine (1 + cos(pi p))/2

D = round(N * decay_ratio) when decay_ratio is set (WSD), else N - W. Past the plan (training.steps
> total_steps) p stays at 1, so the lr stays at min_lr (torchtitan lets p grow past 1 there).

Inconsistent lengths are clamped rather than refused: overriding ``--training.steps`` for a short
smoke test of a big config (warmup 200, steps 10) is common and the clamped schedule is still well
defined. Warmup is clamped to N, then decay to N - warmup. Each clamp logs one line: a WARNING when
it overrides a count the user set (``lr_scheduler.warmup_steps`` in a config file or on the command
line), INFO otherwise (the default warmup; the decay, a ratio of the run's length, shrinking in a
short run) so that a healthy short run prints no warning.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from titan.config.job_config import LRScheduler as LRSchedulerConfig
from titan.log import logger
from titan.training.optim import OptimizersContainer

__all__ = [
    "LRSchedulersContainer",
    "build_lr_schedulers",
    "lr_factor",
    "resolve_schedule",
]


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak lr for 0-based scheduler step ``step`` (see module docstring)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_start = warmup_steps + stable_steps
    if step < decay_start or decay_steps <= 0:
        # Stable, or no decay phase planned (decay_ratio = 0): stay at the peak.
        return 1.0
    progress = min((step + 1 - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay_type {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def resolve_schedule(cfg: LRSchedulerConfig, training_steps: int, explicit: Collection[str] = ()) -> dict[str, Any]:
    """lr_factor's keyword arguments for a validated [lr_scheduler] section (LRScheduler.validate).
    ``explicit``: the config keys a source set (JobConfig.sources): clamping one of them warns."""
    plan = "training.steps"
    if cfg.total_steps is not None:
        training_steps, plan = cfg.total_steps, "lr_scheduler.total_steps"
    warmup = cfg.warmup_steps
    if warmup > training_steps:
        log = logger.warning if "lr_scheduler.warmup_steps" in explicit else logger.info
        log(f"lr_scheduler.warmup_steps ({warmup}) > {plan} ({training_steps}); clamping warmup to {training_steps}")
        warmup = training_steps
    if cfg.decay_ratio is None:
        decay = training_steps - warmup
    else:
        decay = round(training_steps * cfg.decay_ratio)
        if warmup + decay > training_steps:
            logger.info(
                f"lr_scheduler.warmup_steps ({warmup}) + decay steps ({decay} = "
                f"round({training_steps} * decay_ratio {cfg.decay_ratio})) > {plan} "
                f"({training_steps}); clamping decay to {training_steps - warmup} steps"
            )
            decay = training_steps - warmup
    return {
        "warmup_steps": warmup,
        # One virtual step past the plan, as torchtitan: the last step runs just above min_lr.
        "stable_steps": training_steps + 1 - warmup - decay,
        "decay_steps": decay,
        "decay_type": cfg.decay_type,
        "min_lr_factor": cfg.min_lr_factor,
    }


class LRSchedulersContainer:
    """One LambdaLR per optimizer in the container, all following the same schedule.

    The checkpoint stores one scheduler's state (they are identical), so it loads into any number
    of model parts.
    """

    def __init__(self, optimizers: OptimizersContainer, schedule: dict[str, Any]) -> None:
        self.schedule = dict(schedule)
        lr_lambda = functools.partial(lr_factor, **self.schedule)
        self.schedulers = [LambdaLR(opt, lr_lambda) for opt in optimizers]

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> float:
        """The lr the next optimizer step will use (first param group; all parts agree)."""
        return float(self.schedulers[0].get_last_lr()[0])

    def last_step_lr(self) -> float:
        """The lr the optimizer step just taken used: what is logged with that step, as torchtitan
        logs it (get_last_lr, read after the scheduler stepped, is already the next step's). Before
        any step: the first step's lr."""
        sched = self.schedulers[0]
        return float(sched.base_lrs[0] * sched.lr_lambdas[0](max(sched.last_epoch - 1, 0)))

    def state_dict(self) -> dict[str, Any]:
        # lr_lambdas is dropped: the lambda is rebuilt from the config, and its (empty) state
        # would only be a fragile nested entry in the checkpoint.
        state = self.schedulers[0].state_dict()
        state.pop("lr_lambdas", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            state = {k: v for k, v in state_dict.items()}
            # LambdaLR.load_state_dict pops this key; None entries leave our lambdas untouched.
            state["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)
            for key in ("base_lrs", "_last_lr"):
                if key in state:
                    state[key] = list(state[key])
            scheduler.load_state_dict(state)


def build_lr_schedulers(
    optimizers: OptimizersContainer, cfg: LRSchedulerConfig, training_steps: int, explicit: Collection[str] = ()
) -> LRSchedulersContainer:
    """Schedulers for every optimizer in ``optimizers``; sets each lr to the step-1 value.
    ``explicit``: as resolve_schedule's."""
    return LRSchedulersContainer(optimizers, resolve_schedule(cfg, training_steps, explicit))
