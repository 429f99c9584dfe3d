"""scripts/benchmark_replica_groups.py's goodput arithmetic: the step time at full strength leaves
out the steps a failure's recovery overlaps and keeps the periodic ones (checkpoint saves)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runs import script_module

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def bench():
    return script_module("benchmark_replica_groups")


def test_full_strength_keeps_saves_and_leaves_out_recoveries(bench) -> None:
    # Two groups, 1 s per step, every 5th step 0.5 s longer (a save). Group 1 dies after its
    # step 10 at t=10.2 and is back with step 25 at t=30 (healed at t=29.9); group 0's step 11
    # is discarded and retried meanwhile (2 s).
    lines = []
    t = 0.0
    times = {}
    for step in range(1, 41):
        t += 1.0 + (0.5 if step % 5 == 0 else 0.0) + (1.0 if step == 11 else 0.0)
        times[step] = t
        lines.append((t, 0, step, 5.0))
        if step <= 10 or step >= 25:
            lines.append((t, 1, step, 5.0))
    window = (10.2, 29.9)
    step_s = bench.full_strength_step_s(lines, [window])
    # Every delta of group 0 outside the window, and group 1's outside it.
    kept = [
        times[s + 1] - times[s]
        for g in (0, 1)
        for s in range(1, 40)
        if (g == 0 or s < 10 or s >= 25) and not (times[s] < window[1] and times[s + 1] > window[0])
    ]
    assert step_s == pytest.approx(sum(kept) / len(kept))
    assert step_s == pytest.approx(1.1, abs=0.01)  # the saves' 0.5 s every 5 steps stay in
    assert step_s < 1.2  # the retried step and the dead group's gap are left out


def test_stamp_is_titans_own_time(bench) -> None:
    line = "[replica1_rank0]:[titan] 2026-11-26 11:51:22,526 - INFO - step: 196  loss:  4.4243"
    from datetime import datetime

    expected = datetime(2026, 11, 26, 11, 51, 22, 526000).timestamp()
    assert bench._stamp(0.0, line) == pytest.approx(expected)
    assert bench._stamp(7.0, "no stamp here") == 7.0
