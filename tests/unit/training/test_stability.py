"""Spike detection and the non-finite policy on plain numbers (the trainer runs are in
tests/unit/training/test_stability_training.py)."""

import math

import pytest
import torch

from titan.config import load_config
from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.training.stability import SpikeDetector, StabilityMonitor, param_norm, validate_stability_config


def test_grad_norm_spike_counts_events_and_durations():
    d = SpikeDetector("grad-norm", window=4, threshold=0.1, relative=False)
    values = [1.0] * 4 + [1.05, 5.0, 6.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0]
    flags = [d.update(step, v) for step, v in enumerate(values, 1)]
    # 1.05 <= 1.0 + 0.1; 5.0 and 6.0 form one 2-step event; 3.0 later is a second 1-step event
    # (by then the window [1, 1, 1, 1] no longer holds the first spike).
    assert flags == [False] * 5 + [True, True] + [False] * 4 + [True, False]
    assert (d.events, d.spike_steps, d.longest, d.durations) == (2, 3, 2, [2, 1])


def test_no_judgement_before_a_full_window():
    d = SpikeDetector("grad-norm", window=3, threshold=0.1, relative=False)
    assert not any(d.update(s, v) for s, v in enumerate([1.0, 100.0, 1000.0], 1))
    assert d.limit() == pytest.approx(1101.0 / 3 + 0.1)


def test_loss_spike_is_relative():
    d = SpikeDetector("loss", window=2, threshold=0.1, relative=True)
    d.update(1, 10.0)
    d.update(2, 10.0)
    assert not d.update(3, 10.9)  # < 10 * 1.1
    assert d.update(4, 11.5)  # avg(10, 10.9) * 1.1 = 11.495
    assert d.events == 1


def _monitor(policy: str, max_skips: int = 2) -> StabilityMonitor:
    c = JobConfig()
    c.training.nonfinite = policy
    c.training.nonfinite_max_consecutive_skips = max_skips
    c.stability.grad_norm_spike_window = 2
    return StabilityMonitor(c)


def test_stop_names_step_and_metric():
    m = _monitor("stop")
    assert m.check(1, torch.tensor(2.0), torch.tensor(1.0))
    with pytest.raises(TitanError, match=r"non-finite grad_norm = inf at step 7 \(training.nonfinite = stop\)"):
        m.check(7, torch.tensor(2.0), torch.tensor(math.inf))
    with pytest.raises(TitanError, match="non-finite loss = nan, grad_norm = nan at step 8"):
        m.check(8, torch.tensor(math.nan), torch.tensor(math.nan))


def test_skip_counts_and_stops_after_too_many_in_a_row():
    m = _monitor("skip_step", max_skips=2)
    nan = torch.tensor(math.nan)
    assert not m.check(1, nan, torch.tensor(1.0))
    assert not m.check(2, torch.tensor(1.0), nan)
    assert m.check(3, torch.tensor(1.0), torch.tensor(1.0))  # a good step resets the run
    assert not m.check(4, nan, nan) and not m.check(5, nan, nan)
    with pytest.raises(TitanError, match=r"at step 6: 3 consecutive steps skipped.*max_consecutive_skips = 2"):
        m.check(6, nan, nan)
    assert m.skipped_steps == 5
    assert m.scalars()["stability/skipped_steps"] == 5.0
    # skipped steps never reach the spike detectors
    assert list(m.grad_norm.history) == [1.0]


def test_config_checks():
    with pytest.raises(TitanError, match="training.nonfinite.*stop, skip_step"):
        load_config(["--training.nonfinite", "ignore"])
    c = JobConfig()
    c.stability.loss_spike_window = 0
    with pytest.raises(TitanError, match="stability.loss_spike_window"):
        validate_stability_config(c)


def test_param_norm_is_total_l2():
    a, b = torch.nn.Linear(3, 4), torch.nn.Linear(2, 2, bias=False)
    expected = torch.cat([p.detach().flatten() for m in (a, b) for p in m.parameters()]).norm()
    assert param_norm([a, b]).item() == pytest.approx(expected.item(), rel=1e-6)
