"""Warm standbys (titan/launch/standby.py): a process that imported torch and titan before it knew
its rank runs the rank's command line with the rank's environment and output files, and the
launcher tells it from a rank while it waits."""

import os
import signal
import sys
import time

import pytest

from titan.launch.standby import RANK_NAME, STANDBY_NAME, StandbyHandler, StandbyPool, titan_entry
from titan.launch.supervisor import child_pids

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "env", os.environ.get("RANK_ENV"), "warm", "titan.training.trainer" in sys.modules)
print("err", file=sys.stderr)
sys.exit(3)
"""


def test_a_standby_runs_the_ranks_command_line_warm(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    pool = StandbyPool()
    pool.size = 1
    pool.fill()
    try:
        proc = pool.take()
        assert proc is not None
        deadline = time.monotonic() + 60  # a guard: the name is set first thing, before the imports
        while open(f"/proc/{proc.pid}/comm").read().strip() != STANDBY_NAME and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.pid not in child_pids(os.getpid())  # an idle standby is no rank: signals skip it
        out, err = tmp_path / "out.log", tmp_path / "err.log"
        handler = StandbyHandler(proc, ("-u", str(script), "--x", "1"), {"RANK_ENV": "7"}, str(out), str(err), 0)
        while proc.poll() is None and open(f"/proc/{proc.pid}/comm").read().strip() != RANK_NAME:
            time.sleep(0.01)  # it renames itself as soon as it reads its assignment
        assert proc.poll() is not None or proc.pid in child_pids(os.getpid())
        assert proc.wait(timeout=300) == 3
        assert out.read_text() == "argv ['--x', '1'] env 7 warm True\n"
        assert err.read_text() == "err\n"
        handler.close(signal.SIGTERM)  # gone already: nothing to stop
    finally:
        pool.close()


def test_only_titans_entry_point_is_run_by_standbys():
    assert titan_entry(("-u", "train.py", "--job.config_file", "x.toml"))
    assert titan_entry(("-u", "-m", "titan.train"))
    assert titan_entry((f"{os.sep}repo{os.sep}train.py",))
    assert not titan_entry(("-u", "other.py"))
    assert not titan_entry(("-u", "-m", "other.module"))
    assert sys.executable  # the launcher hands standbys only ranks of this interpreter
