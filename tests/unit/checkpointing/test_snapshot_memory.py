"""In-memory snapshots and the host memory they may take: an explicit checkpoint.memory_interval
that does not fit is refused in one line naming the key and what limited it; the default turns
them off and says so (the start-up table too)."""

import pytest

from tests.helpers.runs import SMALL_MODEL, trainer
from titan.errors import TitanError

SMALL = ["--checkpoint.enable", *SMALL_MODEL]
TOO_LITTLE = ["--checkpoint.memory_limit_gib", "0.0001"]  # 0.1 MiB: less than one snapshot


def test_an_interval_that_does_not_fit_is_refused_in_one_line(tmp_path):
    with pytest.raises(TitanError) as e:
        trainer(tmp_path, *SMALL, *TOO_LITTLE, "--checkpoint.memory_interval", "1")
    line = str(e.value)
    assert "\n" not in line and line.startswith("checkpoint.memory_interval = 1: in-memory snapshots need "), line
    assert "MiB is available (checkpoint.memory_limit_gib); valid: a checkpoint.memory_limit_gib" in line, line


def test_by_default_they_are_off_when_they_do_not_fit_and_the_log_says_so(tmp_path, caplog):
    with caplog.at_level("INFO", logger="titan"):
        t = trainer(tmp_path, *SMALL, *TOO_LITTLE, "--training.steps", "2")
        t.train()
    row = "in-memory snapshots  off (checkpoint.memory_interval = -1: every step when they fit): in-memory"
    assert row + " snapshots need" in caplog.text  # the start-up table
    assert t.checkpointer.snapshots is None or t.checkpointer.snapshots.taken == 0
