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


def test_the_first_ranks_start_once_the_config_parses_and_stop_if_the_check_fails(monkeypatch):
    from titan.launch import supervisor
    from titan.launch.standby import PRESTART_ENV

    spawned: list = []
    spawn = StandbyPool._spawn
    monkeypatch.setattr(
        StandbyPool, "_spawn", lambda self, first=False: spawned.append(spawn(self, first)) or spawned[-1]
    )
    handed: list = []  # (the pool torchrun got, its standbys then): the launcher closes what no rank took

    def torchrun(argv, first=None):
        handed.append((first, list(first.ready) if first else []))
        return 0

    monkeypatch.setattr(supervisor, "_torchrun", torchrun)
    # a bad flag: the config does not parse, nothing starts
    assert supervisor.main(["--nproc_per_node", "2", "train.py", "--training.stepz", "3"]) == 2
    assert spawned == [] and handed == []
    # a layout the check refuses (3 ranks, TP 2): started once the config parsed, killed by the failure
    assert supervisor.main(["--nproc_per_node", "3", "train.py", "--parallelism.tensor_parallel_degree", "2"]) == 2
    assert len(spawned) == 3 and [p.poll() for p in spawned] == [-signal.SIGKILL] * 3 and handed == []
    # a good config: torchrun's ranks get them
    spawned.clear()
    assert supervisor.main(["--nproc_per_node", "2", "train.py", "--training.steps", "3"]) == 0
    assert handed[-1][0] is not None and handed[-1][1] == spawned and len(spawned) == 2
    assert handed[-1][0].ready == [] and all(p.poll() is not None for p in spawned)
    monkeypatch.setenv(PRESTART_ENV, "0")
    spawned.clear()
    assert supervisor.main(["--nproc_per_node", "2", "train.py", "--training.steps", "3"]) == 0
    assert handed[-1][0] is None and spawned == []


FAKE_TRAIN = """
import os, sys, time
started = float(os.environ.get("TITAN_PROCESS_STARTED_AT", "nan"))
warm = "titan.training.trainer" in sys.modules
print("rank", os.environ["RANK"], "warm", warm, "started", started, "now", time.time(), flush=True)
"""


def _launch(tmp_path, **env) -> tuple[float, list[str]]:
    import subprocess

    from tests.helpers.distributed import cpu_env

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    script = tmp_path / "train.py"  # titan's entry point by name: the launcher checks its config
    script.write_text(FAKE_TRAIN)
    cmd = [sys.executable, "-m", "titan.launch", "--nproc_per_node", "2", "--rdzv_backend", "c10d"]
    cmd += ["--rdzv_endpoint", "localhost:0", "--local-ranks-filter", "0,1", "--role", "rank", "--tee", "3"]
    cmd += [str(script), "--job.config_file", os.path.join(repo, "train_configs", "debug_model.toml")]
    launched = time.time()
    out = subprocess.run(cmd, cwd=repo, env=cpu_env(**env), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return launched, sorted(ln.split(":", 1)[1] for ln in out.stdout.splitlines() if " warm " in ln)


def test_the_first_attempts_ranks_are_warm_and_count_their_start_from_the_launch(tmp_path):
    launched, lines = _launch(tmp_path)
    assert [ln.split()[:4] for ln in lines] == [["rank", "0", "warm", "True"], ["rank", "1", "warm", "True"]], lines
    # goodput's start-up counts from the standby's own start (the imports it did during the check),
    # not from when torchrun handed it the rank
    assert all(launched <= float(ln.split()[5]) <= float(ln.split()[7]) for ln in lines), (launched, lines)
    _, lines = _launch(tmp_path, TITAN_PRESTART="0")
    assert [ln.split()[:4] for ln in lines] == [["rank", "0", "warm", "False"], ["rank", "1", "warm", "False"]], lines
    assert all(ln.split()[5] == "nan" for ln in lines), lines
