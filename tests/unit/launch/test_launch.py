"""titan.launch without torchrun: the config check, the failure summary, signal forwarding to real
child processes, a rank's watch on its parent, and the peer-lost line."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers.debug_kill import wait_gone
from titan.errors import TitanError
from titan.launch import check, report, supervisor

REPO = Path(__file__).resolve().parents[3]


def test_check_exits_2_with_one_line(capsys):
    assert check.main(["--job.config_file", "nope.toml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("titan: error: config file 'nope.toml' does not exist"), err
    assert check.main(["--job.config_file", "train_configs/debug_model.toml", "--training.stepz", "3"]) == 2
    assert "did you mean 'training.steps'" in capsys.readouterr().err
    assert check.main(["--job.config_file", str(REPO / "train_configs/debug_model.toml")]) == 0


def test_check_answers_help_and_keeps_tracebacks_when_debugging(capsys, monkeypatch):
    assert check.main(["--help", "checkpoint"]) == 0
    assert capsys.readouterr().out.startswith("[checkpoint]")
    assert check.main(["--help", "chekpoint"]) == 2
    assert capsys.readouterr().err.startswith("titan: error: --help: unknown config section 'chekpoint'")
    with pytest.raises(TitanError, match="training.stepz"):
        check.main(["--training.stepz", "3", "--job.debug"])
    monkeypatch.setenv("TITAN_DEBUG", "1")
    with pytest.raises(TitanError, match="does not exist"):
        check.main(["--job.config_file", "nope.toml"])


def test_check_takes_sagemakers_config_file(capsys):
    assert check.main(["--config_file", str(REPO / "train_configs/debug_model.toml")]) == 0
    assert check.main(["--config_file", "nope.toml"]) == 2
    assert capsys.readouterr().err.startswith("titan: error: config file 'nope.toml' does not exist")


@pytest.mark.parametrize("entry", [["train.py"], ["-m", "titan.train"]])
def test_the_launcher_answers_titans_help_without_starting_torchrun(entry, capsys, monkeypatch):
    monkeypatch.setattr(supervisor, "_torchrun", lambda argv, first=None: pytest.fail("torchrun started"))
    assert supervisor.main(["--nproc_per_node", "2", *entry, "--help", "checkpoint"]) == 0
    assert capsys.readouterr().out.startswith("[checkpoint]")
    assert supervisor.main(["--nproc_per_node", "2", *entry, "--training.stepz", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "titan: error: unknown config key 'training.stepz'; did you mean 'training.steps'?"
    ]


def test_the_launcher_checks_only_titans_entry_point(monkeypatch):
    started = []
    monkeypatch.setattr(supervisor, "_torchrun", lambda argv, first=None: started.append(argv) or 0)
    assert supervisor.main(["--nproc_per_node", "2", "other.py", "--training.stepz", "3"]) == 0
    assert started == [["--nproc_per_node", "2", "other.py", "--training.stepz", "3"]]


def test_torchrun_keeps_the_signals_the_launcher_does_not_forward():
    assert supervisor.torchrun_args(["x.py"]).signals_to_handle == "SIGHUP,SIGQUIT"
    assert supervisor.torchrun_args(["--signals_to_handle", "SIGTERM,SIGINT", "x.py"]).signals_to_handle == "SIGHUP"
    assert supervisor.torchrun_args(["--max-restarts", "3", "x.py"]).max_restarts == 3


def test_titan_args_found_without_torchruns_parser():
    assert supervisor.titan_args(["--nproc_per_node", "2", "train.py", "--a", "1"]) == ["--a", "1"]
    assert supervisor.titan_args(["--nnodes", "1", "-m", "titan.train", "--b"]) == ["--b"]
    assert supervisor.titan_args(["--nproc_per_node", "2", "other.py", "train.py"]) is None
    assert supervisor.titan_args(["-m", "other", "train.py"]) is None


def _failure(exitcode: int, message: str = "", timestamp: int = 100, pid: int = 7):
    signame = signal.Signals(-exitcode).name if exitcode < 0 else "<N/A>"
    return SimpleNamespace(
        exitcode=exitcode, message=message, timestamp=timestamp, pid=pid, signal_name=lambda: signame
    )


def test_failure_line_prefers_the_cause_over_its_consequences():
    peer = "titan: error on rank 0: another rank failed during a collective (Connection closed by peer); ..."
    own = "titan: error on rank 1: checkpoint step 2: writing /x failed (No space left on device); ..."
    # the rank that lost its peer may even fail first: the rank with its own error is the cause
    assert supervisor.failure_line({0: _failure(3, peer, 99), 1: _failure(2, own, 100)}, []) == (own, 2)
    # a rank killed by a signal (OOM killer) beats the survivors' "peer lost"
    line, code = supervisor.failure_line({0: _failure(3, peer), 1: _failure(-9, pid=42)}, [])
    assert line.startswith("titan: error: rank 1 (pid 42) was killed by SIGKILL") and code == 137
    # no titan line (a bug: the rank printed its traceback): say where to look, keep its status
    line, code = supervisor.failure_line({1: _failure(1, "To enable traceback see: ...")}, [])
    assert line == "titan: error: rank 1 exited with status 1; its output above says why" and code == 1
    # both ranks hit the same user error; torchrun stopped rank 0 (SIGTERM) after rank 1 exited, in
    # the same second: the line is the cause, not the launcher's SIGTERM
    same = "titan: error: dataset path '/x' does not exist (training.dataset_path)"
    assert supervisor.failure_line({0: _failure(-15, same), 1: _failure(2, same)}, []) == (same, 2)
    assert supervisor.failure_line({0: _failure(-15, same)}, []) == (same, 2)
    # the launcher was signalled while the ranks were still importing: no save was possible
    line, code = supervisor.failure_line({0: _failure(-15)}, [signal.SIGINT])
    assert line.startswith("titan: stopped by SIGINT while the ranks were starting") and code == 143


def test_rank_error_file_holds_the_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "1")
    report.report(TitanError("bad thing (some.key)"), after_init=False)
    assert capsys.readouterr().err == ""  # before init rank 0 alone prints; every rank tells torchrun
    assert json.loads(path.read_text())["message"] == "titan: error: bad thing (some.key)"


_CHILD = """
import signal, sys, time
def got(signum, frame):
    print(signal.Signals(signum).name, flush=True)
signal.signal(signal.SIGTERM, got)
signal.signal(signal.SIGUSR1, got)
print("ready", flush=True)
time.sleep(120)
"""


def test_forwarder_passes_signals_to_the_ranks_and_a_second_ctrl_c_kills(monkeypatch):
    rank = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )  # as torchrun starts a rank: not in our group
    try:
        assert rank.stdout.readline().strip() == "ready"
        assert rank.pid in supervisor.child_pids(os.getpid())
        # only this child: the test process may have others (worker pools of earlier tests)
        monkeypatch.setattr(supervisor, "child_pids", lambda pid: [rank.pid])
        forwarder = supervisor.Forwarder()
        # one at a time: a second signal sent before the first is handled would merge with it
        for sig, seen in [(signal.SIGUSR1, "SIGUSR1"), (signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGTERM")]:
            forwarder.handle(sig, None)  # SIGINT (Ctrl-C) arrives as the ranks' save-and-stop signal
            assert rank.stdout.readline().strip() == seen
        forwarder.handle(signal.SIGINT, None)  # the second Ctrl-C
        assert rank.wait(timeout=30) == -signal.SIGKILL
    finally:
        rank.kill()
        rank.wait()


def test_forwarder_without_ranks_lets_torchrun_shut_down(monkeypatch):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    monkeypatch.setattr(supervisor, "child_pids", lambda pid: [])
    with pytest.raises(SignalException):
        supervisor.Forwarder().handle(signal.SIGTERM, None)


_LAUNCHER = """
import subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(rank.pid, flush=True)
rank.wait()
"""
_RANK = """
import signal, sys, time
sys.path.insert(0, %r)
from titan.launch.parent import watch_parent
signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))  # a rank's handler: save, then exit
watch_parent(poll_s=0.1)
print("watching", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_rank_stops_when_its_launcher_is_killed(monkeypatch):
    # a grace period longer than the wait: only the SIGTERM handler can end the rank in time
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _RANK % str(REPO)], stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "watching"  # the rank (same stdout) armed its watch
        assert _alive(rank)
        launcher.kill()
        launcher.wait()
        assert wait_gone(rank, 300), "the rank outlived its launcher"
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)


def test_peer_lost_line_quotes_the_transport_whole(capsys, monkeypatch, tmp_path):
    import torch.distributed as dist

    import titan.training.trainer
    import train

    gloo = (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
        "[127.0.0.1]:22345 while waiting for the remote side of an operation that was in progress on the"
        " pair that serves rank 1"
    )

    class Lost:
        def __init__(self, config):
            raise RuntimeError(gloo)

    monkeypatch.setattr(titan.training.trainer, "Trainer", Lost)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr("titan.parallel.utils.destroy_distributed", lambda: None)
    monkeypatch.setenv("RANK", "0")
    assert (
        train.main(
            ["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", str(tmp_path)]
        )
        == 3
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(Connection closed by peer);" in err[0] and "22345" not in err[0], err


def _torchrun_ending_with(error: BaseException, monkeypatch, tmp_path) -> int:
    """supervisor.main around a torchrun run() that ends with ``error`` (signal handlers and
    environment left as they were)."""
    import torch.distributed.run

    def run(args):
        raise error

    monkeypatch.setattr(torch.distributed.run, "run", run)
    monkeypatch.setattr(supervisor.Forwarder, "install", lambda self: None)
    monkeypatch.setenv(supervisor.LAUNCHER_PID_ENV, "")
    monkeypatch.setenv("TITAN_LAUNCH_SUMMARY", str(tmp_path / "summary"))
    return supervisor.main(["--nproc_per_node", "1", "other.py"])


def test_a_signal_before_the_ranks_started_ends_with_128_plus_it(monkeypatch, tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    error = SignalException("launcher got SIGTERM", sigval=signal.SIGTERM)
    assert _torchrun_ending_with(error, monkeypatch, tmp_path) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == (
        "titan: stopped by SIGTERM (torchrun sent it to the ranks, if any were running)"
    )


def test_the_run_ended_by_another_node_says_so_last(monkeypatch, tmp_path, capsys):
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    assert _torchrun_ending_with(RendezvousClosedError(), monkeypatch, tmp_path) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("titan: error: the run ended on another node while this one restarted its ranks"), last
    assert (tmp_path / "summary").read_text() == last + "\n"
