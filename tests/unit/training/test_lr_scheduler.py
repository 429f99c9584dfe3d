from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan.config import load_config
from titan.config.job_config import LRScheduler as LRSchedulerConfig
from titan.config.job_config import Optimizer as OptimizerConfig
from titan.errors import TitanError
from titan.training.lr_scheduler import build_lr_schedulers, lr_factor, resolve_schedule
from titan.training.optim import build_optimizers

PEAK = 1e-3
REPO = Path(__file__).resolve().parents[3]


def _lrs(cfg: LRSchedulerConfig, steps: int, n_parts: int = 1, extra: int = 0) -> list[float]:
    """The lr used by optimizer steps 1..steps+extra, read as the trainer would."""
    parts = [nn.Linear(2, 2) for _ in range(n_parts)]
    opt = build_optimizers(parts, OptimizerConfig(lr=PEAK))
    sched = build_lr_schedulers(opt, cfg, steps)
    out = []
    for _ in range(steps + extra):
        lrs = {g["lr"] for o in opt for g in o.param_groups}
        assert len(lrs) == 1 and lrs.pop() == pytest.approx(sched.get_last_lr(), abs=0)
        used = sched.get_last_lr()
        out.append(used / PEAK)
        opt.step()
        sched.step()
        # What the trainer logs with the step: the rate it used, not the next step's.
        assert sched.last_step_lr() == used
    return out


def test_wsd_linear_by_hand() -> None:
    # steps 10, warmup 2, decay_ratio 0.5 -> decay 5 steps, stable 10 + 1 - 2 - 5 = 4 steps.
    cfg = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.5, decay_type="linear")
    expected = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0]
    assert _lrs(cfg, 10, extra=1) == pytest.approx(expected, abs=1e-12)


def test_wsd_min_lr_by_hand() -> None:
    cfg = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1)
    expected = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1]
    assert _lrs(cfg, 10, extra=1) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "decay_type, at_step4, at_step7, at_step10",
    [
        # No decay_ratio: decay over the 8 steps after warmup, after one stable step; optimizer step 4
        # runs at p = 1/8, step 7 at p = 1/2, the last step at p = 7/8.
        ("linear", 0.875, 0.5, 0.125),
        ("sqrt", 1 - math.sqrt(1 / 8), 1 - math.sqrt(0.5), 1 - math.sqrt(7 / 8)),
        ("cosine", 0.5 * (1 + math.cos(math.pi / 8)), 0.5, 0.5 * (1 + math.cos(7 * math.pi / 8))),
    ],
)
def test_decay_types_by_hand(decay_type: str, at_step4: float, at_step7: float, at_step10: float) -> None:
    lrs = _lrs(LRSchedulerConfig(warmup_steps=2, decay_type=decay_type), 10)
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[3] == pytest.approx(at_step4, abs=1e-12)
    assert lrs[6] == pytest.approx(at_step7, abs=1e-12)
    assert lrs[9] == pytest.approx(at_step10, abs=1e-12)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))


def test_no_warmup_first_lr_positive_and_decay_ratio_zero_is_constant() -> None:
    assert _lrs(LRSchedulerConfig(warmup_steps=0, decay_ratio=0.0), 5) == [1.0] * 5
    first = _lrs(LRSchedulerConfig(warmup_steps=0), 4)
    assert first == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_all_parts_follow_one_schedule() -> None:
    cfg = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.5)
    assert _lrs(cfg, 10, n_parts=3) == _lrs(cfg, 10, n_parts=1)


def test_clamping_warns_only_over_an_explicit_setting(caplog: pytest.LogCaptureFixture) -> None:
    # warmup_steps set by the user (a config file, the command line) and overridden: a WARNING
    with caplog.at_level(logging.INFO, logger="titan"):
        sched = resolve_schedule(LRSchedulerConfig(warmup_steps=20), 10, {"lr_scheduler.warmup_steps": "cli"})
    assert sched["warmup_steps"] == 10 and sched["decay_steps"] == 0
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "lr_scheduler.warmup_steps (20) > training.steps (10); clamping warmup to 10")
    ]
    caplog.clear()
    # the default warmup in a short run: INFO
    with caplog.at_level(logging.INFO, logger="titan"):
        resolve_schedule(LRSchedulerConfig(warmup_steps=20), 10)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    caplog.clear()
    # the decay (a ratio of the run's length) shrinking in a short run: INFO, even when set
    with caplog.at_level(logging.INFO, logger="titan"):
        explicit = {"lr_scheduler.warmup_steps": "f.toml:2", "lr_scheduler.decay_ratio": "f.toml:3"}
        sched = resolve_schedule(LRSchedulerConfig(warmup_steps=2, decay_ratio=0.9), 10, explicit)
    assert (sched["warmup_steps"], sched["stable_steps"], sched["decay_steps"]) == (2, 1, 8)
    assert [r.levelname for r in caplog.records] == ["INFO"] and "clamping decay to 8 steps" in caplog.text


def test_the_logged_lr_is_the_rate_of_the_step() -> None:
    opt = build_optimizers([nn.Linear(2, 2)], OptimizerConfig(lr=PEAK))
    sched = build_lr_schedulers(opt, LRSchedulerConfig(warmup_steps=4), 8)
    assert sched.last_step_lr() == sched.get_last_lr() == PEAK / 4  # before step 1: step 1's
    opt.step()
    sched.step()
    # step 1 ran at 1/4 of the peak (warmup); the next one will run at 2/4
    assert (sched.last_step_lr(), sched.get_last_lr()) == (PEAK / 4, PEAK * 2 / 4)


def test_the_debug_config_cut_short_warns_about_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # `./run_train.sh --training.steps 20`: the decay of the shipped schedule shrinks (INFO)
    config = load_config(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--training.steps", "20"])
    with caplog.at_level(logging.INFO, logger="titan"):
        resolve_schedule(config.lr_scheduler, config.training.steps, config.sources)
    assert [r.levelname for r in caplog.records] == ["INFO"], caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"warmup_steps": -1}, "config key 'lr_scheduler.warmup_steps' got -1; valid: an integer >= 0"),
        ({"decay_ratio": 1.5}, "config key 'lr_scheduler.decay_ratio' got 1.5; valid: a number in [0, 1], or unset"),
        ({"min_lr_factor": -0.1}, "config key 'lr_scheduler.min_lr_factor' got -0.1; valid: a number in [0, 1]"),
    ],
)
def test_bad_config(kwargs: dict, message: str) -> None:
    with pytest.raises(TitanError) as info:
        LRSchedulerConfig(**kwargs).validate()
    assert message in str(info.value)


def test_lr_factor_is_pure() -> None:
    kw = dict(warmup_steps=0, stable_steps=0, decay_steps=4, decay_type="cosine", min_lr_factor=0.2)
    assert lr_factor(1, **kw) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(100, **kw) == pytest.approx(0.2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_continues_exactly(tmp_path) -> None:
    cfg = LRSchedulerConfig(warmup_steps=3, decay_ratio=0.4, decay_type="cosine", min_lr_factor=0.1)
    steps = 12
    uninterrupted = _lrs(cfg, steps)

    parts = [nn.Linear(2, 2), nn.Linear(2, 2)]
    opt = build_optimizers(parts, OptimizerConfig(lr=PEAK))
    sched = build_lr_schedulers(opt, cfg, steps)
    seen = []
    for _ in range(5):
        seen.append(sched.get_last_lr() / PEAK)
        opt.step()
        sched.step()
    dcp.save({"lr_scheduler": sched.state_dict()}, checkpoint_id=str(tmp_path))

    # Resume with a different layout (one part) through DCP.
    new_opt = build_optimizers([nn.Linear(2, 2)], OptimizerConfig(lr=PEAK))
    new_sched = build_lr_schedulers(new_opt, cfg, steps)
    state = {"lr_scheduler": new_sched.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    new_sched.load_state_dict(state["lr_scheduler"])
    assert new_sched.schedulers[0].last_epoch == 5
    # The optimizer's lr comes back with the optimizer state in a real resume; here only the
    # scheduler was restored, so the next value is read from the scheduler.
    for _ in range(steps - 5):
        seen.append(new_sched.get_last_lr() / PEAK)
        new_opt.step()
        new_sched.step()
        assert new_opt.optimizers[0].param_groups[0]["lr"] == new_sched.get_last_lr()
    assert seen == pytest.approx(uninterrupted, abs=0)


def test_lr_used_by_optimizer_matches_schedule() -> None:
    p = nn.Parameter(torch.zeros(1))
    opt = build_optimizers([nn.ParameterList([p])], OptimizerConfig(lr=PEAK, weight_decay=0.0))
    sched = build_lr_schedulers(opt, LRSchedulerConfig(warmup_steps=2, decay_ratio=0.5), 10)
    p.grad = torch.ones(1)
    opt.step()  # first Adam step moves by lr * sign(grad) (up to eps)
    assert -p.item() == pytest.approx(PEAK / 2, rel=1e-5)
    sched.step()
