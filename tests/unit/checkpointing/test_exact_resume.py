"""Exact resume at the debug model's size: 20 steps uninterrupted vs 10,
stop (SIGTERM: save and exit), resume to 20 -> identical losses at every step, bitwise (CPU fp32),
for 1 rank and 2-rank FSDP2, with sync and async saves."""

from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.runs import signal_during
from tests.helpers.runs import trainer as tiny_trainer

pytestmark = pytest.mark.slow
STEPS = ["--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "10"]


def _ref_and_resumed(tmp: Path, async_mode: str) -> tuple[dict, dict]:
    mode = ["--checkpoint.async_mode", async_mode]
    ref = tiny_trainer(tmp / f"ref_{async_mode}", *STEPS, *mode).train()
    first = tiny_trainer(tmp / f"run_{async_mode}", *STEPS, *mode)
    signal_during(first, 10, send=True)
    stopped = first.train()
    resumed = tiny_trainer(tmp / f"run_{async_mode}", *STEPS, *mode)
    assert resumed.step == 10
    return ref, {**stopped, **resumed.train()}


def _two_ranks(rank: int, world: int, tmp: str) -> list[tuple[dict, dict]]:
    return [_ref_and_resumed(Path(tmp), mode) for mode in ("disabled", "async")]


def test_exact_resume_one_rank(tmp_path):
    for mode in ("disabled", "async"):
        ref, resumed = _ref_and_resumed(tmp_path, mode)
        assert sorted(ref) == list(range(1, 21))
        assert resumed == ref, mode  # every step, bitwise


def test_exact_resume_two_rank_fsdp(tmp_path):
    for rank_result in run_distributed(_two_ranks, 2, str(tmp_path), timeout=600):
        for ref, resumed in rank_result:
            assert sorted(ref) == list(range(1, 21))
            assert resumed == ref
