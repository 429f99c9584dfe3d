"""The test-side kill points (tests/helpers/debug_kill.py): parsed from TITAN_DEBUG_KILL_AT, put
into the checkpoint manager from outside titan, and reaching a train.py subprocess through its
environment."""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers.debug_kill import DebugKill, install, kill_env
from tests.helpers.runs import REPO, train_subprocess
from titan.checkpointing.manager import CheckpointManager
from titan.errors import TitanError


def test_debug_kill_hook():
    with pytest.raises(TitanError, match="TITAN_DEBUG_KILL_AT"):
        DebugKill("save@4")
    DebugKill("")("step", 4)  # unset: nothing
    DebugKill("save:step=4")("step", 4)  # other point: nothing
    code = "from tests.helpers.debug_kill import DebugKill; DebugKill()('save', 4); print('alive')"
    env = dict(os.environ, TITAN_DEBUG_KILL_AT="save:step=4")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL and "alive" not in out.stdout


def test_debug_kill_at_one_attempt_only(monkeypatch):
    """``@attemptA``: only torchrun's restart A fails, so a restarted run can get past the point."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not DebugKill("error:step=3@attempt0").here()
    DebugKill("error:step=3@attempt0")("step", 3)  # another attempt's point: nothing
    with pytest.raises(TitanError, match="injected failure after step 3"):
        DebugKill("error:step=3@attempt1")("step", 3)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")  # not under torchrun: the first attempt
    assert DebugKill("step=3@rank0@attempt0").here()


def test_points_that_pause_or_interrupt():
    assert (DebugKill("hold:step=3").point, DebugKill("hold:step=3").step) == ("hold", 3)
    assert (DebugKill("stop:committed=6").point, DebugKill("stop:committed=6").step) == ("committed", 6)
    assert (DebugKill("interrupt:shard=0").point, DebugKill("interrupt:shard=0").step) == ("shard", 0)
    for bad in ("hold:shard=1", "stop:step=2", "interrupt:step=1"):
        with pytest.raises(TitanError, match="valid: "):
            DebugKill(bad)


def test_install_wraps_the_step_hook_and_leaves_titan_alone_when_unset(monkeypatch):
    monkeypatch.setattr(CheckpointManager, "after_step", CheckpointManager.after_step)
    monkeypatch.setattr(CheckpointManager, "_commit", CheckpointManager._commit)
    original = CheckpointManager.after_step
    install(DebugKill(""))
    assert CheckpointManager.after_step is original
    install(DebugKill("error:step=3"))
    assert CheckpointManager.after_step is not original
    with pytest.raises(TitanError, match="injected failure after step 3"):
        CheckpointManager.after_step(None, 3)  # type: ignore[arg-type]  # raises before using the manager


def test_kill_env_puts_the_site_hook_first_on_the_path():
    env = kill_env("step=2", {"PYTHONPATH": "/x"})
    assert env["TITAN_DEBUG_KILL_AT"] == "step=2"
    assert env["PYTHONPATH"].split(os.pathsep)[1:] == ["/x"] and env["PYTHONPATH"].endswith("kill_site:/x")


@pytest.mark.slow
def test_train_subprocess_is_killed_at_the_step_point(tmp_path):
    rc, text, steps = train_subprocess(
        tmp_path, "--training.steps", "3", "--checkpoint.interval", "2", kill_at="step=2"
    )
    assert rc == -signal.SIGKILL and sorted(steps) == [1, 2], text[-3000:]
    assert "TITAN_DEBUG_KILL_AT: SIGKILL at step of step 2" in text
    # the point comes after the step's interval save and its line, before the next step
    assert (tmp_path / "checkpoint" / "step-2").is_dir() and not (tmp_path / "checkpoint" / "step-3").exists()
