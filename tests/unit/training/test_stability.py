"""Spike detection and the non-finite policy on plain numbers (the trainer runs are in
tests/unit/training/test_stability_training.py)."""

import json
import math
from pathlib import Path

import pytest
import torch

from titan.config import load_config
from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.training.stability import SpikeDetector, StabilityMonitor, param_norm

# Loss and grad norm of every step of the default demo (./run_train.sh: 150 steps of the debug model).
DEMO = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "demo_curves.json").read_text())


def _default_detector(name: str) -> SpikeDetector:
    s = JobConfig().stability
    window, threshold = {
        "grad_norm": (s.grad_norm_spike_window, s.grad_norm_spike_threshold),
        "loss": (s.loss_spike_window, s.loss_spike_threshold),
    }[name]
    return SpikeDetector(name, window, threshold, relative=True)


@pytest.mark.parametrize("name", ["grad_norm", "loss"])
def test_defaults_are_quiet_on_the_demo_and_catch_a_10x_spike(name):
    series = DEMO[name]
    assert len(series) == 150
    quiet = _default_detector(name)
    assert not any(quiet.update(step, v) for step, v in enumerate(series, 1))
    for at in (25, 90, 140):
        d = _default_detector(name)
        flags = [d.update(step, v * 10 if step == at else v) for step, v in enumerate(series, 1)]
        assert [step for step, spike in enumerate(flags, 1) if spike] == [at]
    # the former defaults (absolute 0.1 above the grad-norm average, 10% above the loss average) were not quiet
    old = SpikeDetector(name, 20, 0.1, relative=name == "loss")
    assert any([old.update(step, v) for step, v in enumerate(series, 1)])


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
    c.stability.grad_norm_spike_window = 2
    return StabilityMonitor(c.stability, nonfinite=policy, max_consecutive_skips=max_skips)


def _log_step(m: StabilityMonitor, step: int, loss: float, grad_norm: float) -> bool:
    """One step logged (log_freq = 1): the device decision, then the log step's read."""
    loss_t, grad_norm_t = torch.tensor(loss), torch.tensor(grad_norm)
    apply = m.check(step, loss_t, grad_norm_t)
    m.read(step, loss_t, grad_norm_t)
    return bool(apply)


def test_stop_names_step_and_metric():
    m = _monitor("stop")
    assert _log_step(m, 1, 2.0, 1.0)
    with pytest.raises(TitanError, match=r"non-finite grad_norm = inf at step 7 \(training.nonfinite = stop\)"):
        _log_step(m, 7, 2.0, math.inf)
    m = _monitor("stop")
    with pytest.raises(TitanError, match="non-finite loss = nan, grad_norm = nan at step 8"):
        _log_step(m, 8, math.nan, math.nan)


def test_stop_between_log_steps_names_the_first_bad_step():
    m = _monitor("stop")
    for step, gn in ((1, 1.0), (2, math.inf), (3, math.nan)):
        m.check(step, torch.tensor(2.0), torch.tensor(gn))  # no read, no raise
    with pytest.raises(TitanError, match=r"grad_norm = inf at step 2 \(training.nonfinite = stop\).*found at step 4"):
        m.resolve(4)


def test_skip_counts_and_stops_after_too_many_in_a_row():
    m = _monitor("skip_step", max_skips=2)
    nan = math.nan
    assert not _log_step(m, 1, nan, 1.0)
    assert not _log_step(m, 2, 1.0, nan)
    assert _log_step(m, 3, 1.0, 1.0)  # a good step resets the run
    assert not _log_step(m, 4, nan, nan) and not _log_step(m, 5, nan, nan)
    with pytest.raises(TitanError, match=r"at step 6: 3 consecutive steps skipped.*max_consecutive_skips = 2"):
        _log_step(m, 6, nan, nan)
    assert m.skipped_steps == 4  # as of the last read before the one that stopped
    assert m.scalars()["stability/skipped_steps"] == 4.0
    # skipped steps never reach the spike detectors
    assert list(m.grad_norm.history) == [1.0]


def test_grad_norm_spike_between_log_steps_is_seen_at_the_next_one():
    m = _monitor("stop")
    step = 0
    for _ in range(3):  # log_freq 3: three log windows of ~1.0 fill the window of 2
        for _ in range(3):
            step += 1
            m.check(step, torch.tensor(2.0), torch.tensor(1.0))
        m.read(step, torch.tensor(2.0), torch.tensor(1.0))
    m.check(10, torch.tensor(2.0), torch.tensor(10.0))  # a 10x grad norm on a step that logs nothing
    m.check(11, torch.tensor(2.0), torch.tensor(1.0))
    m.check(12, torch.tensor(2.0), torch.tensor(1.0))
    m.read(12, torch.tensor(2.0), torch.tensor(1.0))
    assert (m.grad_norm.events, m.grad_norm.spike_steps) == (1, 1)


def test_config_checks():
    with pytest.raises(TitanError, match="training.nonfinite.*stop, skip_step"):
        load_config(["--training.nonfinite", "ignore"])
    c = JobConfig()
    c.stability.loss_spike_window = 0
    with pytest.raises(TitanError, match="stability.loss_spike_window"):
        c.stability.validate()


def test_param_norm_is_total_l2():
    a, b = torch.nn.Linear(3, 4), torch.nn.Linear(2, 2, bias=False)
    expected = torch.cat([p.detach().flatten() for m in (a, b) for p in m.parameters()]).norm()
    assert param_norm([a, b]).item() == pytest.approx(expected.item(), rel=1e-6)
