"""titan's lr schedule equals torchtitan's at every planned step, over a grid of configs.

torchtitan cannot be imported here, so its schedule is transcribed below from torchtitan v0.2.2,
torchtitan/components/lr_scheduler.py (build_lr_schedulers + linear_warmup_stable_decay),
keeping its structure: the clamping of warmup and decay, the virtual last step
(stable = N + 1 - W - D), and the 0-indexed step + 1 adjustments.
"""

from __future__ import annotations

import itertools
import math

import pytest
from torch import nn

from titan.config.job_config import LRScheduler as LRSchedulerConfig
from titan.config.job_config import Optimizer as OptimizerConfig
from titan.training.lr_scheduler import build_lr_schedulers
from titan.training.optim import build_optimizers


def torchtitan_v022_factors(
    steps: int,
    warmup: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
    total_steps: int | None = None,
) -> list[float]:
    total = total_steps if total_steps is not None else steps
    warmup = min(warmup, total)
    if decay_ratio is not None:
        decay = round(total * decay_ratio)
        if warmup + decay > total:
            decay = total - warmup
    else:
        decay = total - warmup
    stable = total + 1 - warmup - decay

    def factor(current_step: int) -> float:
        warmup_stable = warmup + stable
        if current_step < warmup:
            current_step += 1
            return float(current_step / warmup)
        if current_step < warmup_stable:
            return 1.0
        current_step += 1
        progress = float(current_step - warmup_stable) / decay
        if decay_type == "linear":
            adj = 1 - progress
        elif decay_type == "sqrt":
            adj = 1 - math.sqrt(progress)
        else:
            adj = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_factor + (1 - min_lr_factor) * adj

    return [factor(s) for s in range(steps)]


def titan_factors(steps: int, cfg: LRSchedulerConfig) -> list[float]:
    """The lr each optimizer step uses, read from the optimizer as the trainer runs it."""
    opt = build_optimizers([nn.Linear(2, 2)], OptimizerConfig(lr=1.0))
    sched = build_lr_schedulers(opt, cfg, steps)
    out = []
    for _ in range(steps):
        out.append(opt.optimizers[0].param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


GRID = list(
    itertools.product(
        (1, 2, 7, 10, 40),  # training.steps
        (0, 1, 2, 5, 12),  # warmup_steps
        (None, 0.0, 0.1, 0.5, 0.8, 1.0),  # decay_ratio
        ("linear", "sqrt", "cosine"),
        (0.0, 0.1),  # min_lr_factor
    )
)


def test_grid_matches_torchtitan() -> None:
    checked = 0
    for steps, warmup, ratio, decay_type, min_lr in GRID:
        cfg = LRSchedulerConfig(warmup_steps=warmup, decay_ratio=ratio, decay_type=decay_type, min_lr_factor=min_lr)
        ours = titan_factors(steps, cfg)
        theirs = torchtitan_v022_factors(steps, warmup, ratio, decay_type, min_lr)
        assert ours == pytest.approx(theirs, abs=1e-12), (steps, warmup, ratio, decay_type, min_lr)
        checked += 1
    assert checked == len(GRID) == 900


@pytest.mark.parametrize("total_steps", [12, 30])
def test_total_steps_plans_a_longer_schedule(total_steps: int) -> None:
    cfg = LRSchedulerConfig(
        warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1, total_steps=total_steps
    )
    ours = titan_factors(20, cfg)
    theirs = torchtitan_v022_factors(20, 3, 0.5, "cosine", 0.1, total_steps=total_steps)
    planned = min(20, total_steps)
    assert ours[:planned] == pytest.approx(theirs[:planned], abs=1e-12)
    # Past the plan titan holds min_lr (torchtitan's progress would pass 1 and the cosine rise again).
    assert ours[planned:] == pytest.approx([0.1] * (20 - planned), abs=1e-12)


def test_the_measured_config_warmup_2_decay_08() -> None:
    """The config whose loss curves parted from torchtitan's at step 6 (20 steps, warmup 2,
    decay_ratio 0.8): step 6 now runs at the same lr."""
    cfg = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.8)
    ours = titan_factors(20, cfg)
    assert ours[:6] == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 0.9375], abs=1e-12)
    assert ours == pytest.approx(torchtitan_v022_factors(20, 2, 0.8, "linear", 0.0), abs=1e-12)
