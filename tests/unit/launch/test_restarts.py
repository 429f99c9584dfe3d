"""The restart decision titan's launcher adds to torchrun's agent: a rank killed or crashed is
restarted while the budget lasts (the cause goes to the next ranks), a titan user error or a
signal to the launcher never is, and the last line names the spent budget."""

import os
import signal
from types import SimpleNamespace

import pytest

from titan.launch import restarts, supervisor


def _failure(exitcode: int, message: str = "", pid: int = 7):
    signame = signal.Signals(-exitcode).name if exitcode < 0 else "<N/A>"
    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=100, pid=pid, signal_name=lambda: signame)


def _policy(max_restarts: int, received: list[int] | None = None) -> restarts.RestartPolicy:
    received = [] if received is None else received
    return restarts.RestartPolicy(max_restarts, lambda f: supervisor.failure_line(f, received), lambda: bool(received))


PEER = "titan: error on rank 0: another rank failed during a collective (Connection reset by peer); ..."


def test_a_killed_rank_is_restarted_and_the_cause_goes_to_the_next_ranks(monkeypatch, capsys):
    monkeypatch.delenv(restarts.RESTART_CAUSE_ENV, raising=False)
    policy = _policy(3)
    # rank 0 reported its lost peer but torchrun stopped it (SIGTERM) before it exited 3: not the cause
    assert policy.on_failure({0: _failure(-15, PEER), 1: _failure(-9, pid=42)}, remaining=3) == 3
    cause = "titan: error: rank 1 (pid 42) was killed by SIGKILL; the other ranks stopped with it"
    assert os.environ[restarts.RESTART_CAUSE_ENV].startswith(cause)
    assert "restarting the ranks (restart 1 of 3)" in capsys.readouterr().err
    # a crash (a traceback, status 1) is restarted too: it may be transient
    assert policy.on_failure({1: _failure(1, "To enable traceback see: ...")}, remaining=2) == 2
    assert policy.restarts == 2
    # killed during start-up, the survivor stopped by torchrun's SIGTERM first: the SIGKILL is the cause
    line, _ = supervisor.failure_line({0: _failure(-15, pid=41), 1: _failure(-9, pid=42)}, [])
    assert line.startswith("titan: error: rank 1 (pid 42) was killed by SIGKILL"), line
    # out of budget: the agent ends the run, and the last line says so
    assert policy.on_failure({1: _failure(-9, pid=43)}, remaining=1) == 1
    assert policy.on_failure({1: _failure(-9, pid=44)}, remaining=0) == 0
    line = policy.final_line(supervisor.failure_line({1: _failure(-9, pid=44)}, [])[0])
    assert line.startswith("titan: error: rank 1 (pid 44) was killed by SIGKILL") and line.endswith(
        "(gave up after 3 restart(s): --max-restarts 3)"
    ), line


@pytest.mark.parametrize("exitcode", [2, -15], ids=["exited-2", "stopped-after-writing-its-line"])
def test_a_titan_error_is_never_restarted(exitcode, capsys):
    policy = _policy(3)
    line = "titan: error: dataset path '/x' does not exist (training.dataset_path)"
    assert policy.on_failure({0: _failure(exitcode, line), 1: _failure(3, PEER)}, remaining=3) == 0
    assert policy.restarts == 0 and policy.final_line(line) == line
    assert "not restarting after a titan error" in capsys.readouterr().err


def test_a_signal_to_the_launcher_is_never_restarted():
    policy = _policy(3, received=[signal.SIGTERM])
    assert policy.on_failure({1: _failure(-9)}, remaining=3) == 0 and policy.restarts == 0


def test_the_agent_class_is_ours_for_one_run_only():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    with restarts.policy_installed(_policy(1)):
        ours = getattr(api, "LocalElasticAgent")  # noqa: B009
        assert issubclass(ours, LocalElasticAgent) and ours is not LocalElasticAgent
    assert getattr(api, "LocalElasticAgent") is LocalElasticAgent  # noqa: B009
