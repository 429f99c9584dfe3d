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
        # a rank now, unless it has already run and exited (its zombie is no rank: polled after the listing)
        assert proc.pid in child_pids(os.getpid()) or proc.poll() is not None
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
    from titan.launch import standby, supervisor
    from titan.launch.standby import PRESTART_ENV

    spawned: list = []
    spawn = StandbyPool._spawn
    monkeypatch.setattr(
        StandbyPool, "_spawn", lambda self, first=False: spawned.append(spawn(self, first)) or spawned[-1]
    )
    zygotes: list = []  # the warm process the standbys are forked from

    class Recorded(standby.Zygote):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            zygotes.append(self)

    monkeypatch.setattr(standby, "Zygote", Recorded)
    handed: list = []  # (the pool torchrun got, its standbys then): the launcher closes what no rank took

    def torchrun(argv, first=None):
        handed.append((first, first.started() if first else []))
        return 0

    monkeypatch.setattr(supervisor, "_torchrun", torchrun)
    # a bad flag: the config does not parse, nothing starts
    assert supervisor.main(["--nproc_per_node", "2", "train.py", "--training.stepz", "3"]) == 2
    assert spawned == [] and zygotes == [] and handed == []
    # a layout the check refuses (3 ranks, TP 2): started once the config parsed, killed by the failure
    # (the zygote, and any standby it had forked already)
    assert supervisor.main(["--nproc_per_node", "3", "train.py", "--parallelism.tensor_parallel_degree", "2"]) == 2
    assert len(zygotes) == 1 and zygotes[0].proc.poll() == -signal.SIGKILL and handed == []
    assert all(p.poll() == -signal.SIGKILL for p in spawned if p is not None)
    # a good config: torchrun's ranks get them, forks of one zygote, which ends with the launch
    spawned.clear()
    assert supervisor.main(["--nproc_per_node", "2", "train.py", "--training.steps", "3"]) == 0
    assert handed[-1][0] is not None and handed[-1][1] == spawned and len(spawned) == 2
    assert handed[-1][0].ready == [] and all(p.poll() is not None for p in spawned)
    assert len(zygotes) == 2 and zygotes[1].proc.poll() == 0
    monkeypatch.setenv(PRESTART_ENV, "0")
    spawned.clear()
    assert supervisor.main(["--nproc_per_node", "2", "train.py", "--training.steps", "3"]) == 0
    assert handed[-1][0] is None and spawned == [] and len(zygotes) == 2


FAKE_TRAIN = """
import os, sys, time
started = float(os.environ.get("TITAN_PROCESS_STARTED_AT", "nan"))
warm = "titan.training.trainer" in sys.modules
import torch
threads = torch.get_num_threads()
print("rank", os.environ["RANK"], "warm", warm, "started", started, "now", time.time(), "threads", threads, flush=True)
"""


def _launch(tmp_path, drop: str = "", **env) -> tuple[float, list[str]]:
    import subprocess

    from tests.helpers.distributed import cpu_env

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    script = tmp_path / "train.py"  # titan's entry point by name: the launcher checks its config
    script.write_text(FAKE_TRAIN)
    cmd = [sys.executable, "-m", "titan.launch", "--nproc_per_node", "2", "--rdzv_backend", "c10d"]
    cmd += ["--rdzv_endpoint", "localhost:0", "--local-ranks-filter", "0,1", "--role", "rank", "--tee", "3"]
    cmd += [str(script), "--job.config_file", os.path.join(repo, "train_configs", "debug_model.toml")]
    launched = time.time()
    environ = cpu_env(**env)
    environ.pop(drop, None)
    out = subprocess.run(cmd, cwd=repo, env=environ, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return launched, sorted(ln.split(":", 1)[1] for ln in out.stdout.splitlines() if " warm " in ln)


def test_the_first_attempts_ranks_are_warm_and_count_their_start_from_the_launch(tmp_path):
    # torchrun gives each of 2 ranks one OpenMP thread where the launcher's environment names none; the
    # warm process imported torch before that environment existed, with a thread per core
    launched, lines = _launch(tmp_path, drop="OMP_NUM_THREADS")
    assert [ln.split()[:4] for ln in lines] == [["rank", "0", "warm", "True"], ["rank", "1", "warm", "True"]], lines
    assert all(ln.split()[9] == "1" for ln in lines), lines
    # goodput's start-up counts from the standby's own start (the imports it did during the check),
    # not from when torchrun handed it the rank
    assert all(launched <= float(ln.split()[5]) <= float(ln.split()[7]) for ln in lines), (launched, lines)
    _, lines = _launch(tmp_path, TITAN_PRESTART="0")
    assert [ln.split()[:4] for ln in lines] == [["rank", "0", "warm", "False"], ["rank", "1", "warm", "False"]], lines
    assert all(ln.split()[5] == "nan" for ln in lines), lines
