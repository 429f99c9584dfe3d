"""What the launcher says about a failed rank: a hidden rank's last error lines (once), a SIGKILL
without a guess, the world size it checks the layout for, and a rank's line left to the launcher."""

import json
import signal
from types import SimpleNamespace

import pytest

from titan.errors import TitanError
from titan.launch import causes, check, report, restarts, supervisor
from titan.training.checks import CHECKED_ENV

TRACEBACK = """[titan] 2026-01-01 00:00:00,000 - INFO - step:  5  loss:  7.1
Traceback (most recent call last):
  File "train.py", line 10, in <module>
    main()
  File "titan/parallel/expert_parallel.py", line 88, in dispatch
    out = all_to_all(x, splits)
RuntimeError: Split sizes doesn't match total dim 0 size
[W1127 14:00:00.000 ProcessGroup.cpp:1] destroy_process_group() was not called
"""


def _failure(exitcode, message="", local_rank=0, pid=7):
    signame = signal.Signals(-exitcode).name if exitcode < 0 else "<N/A>"
    return SimpleNamespace(
        exitcode=exitcode, message=message, timestamp=1, pid=pid, local_rank=local_rank, signal_name=lambda: signame
    )


def test_error_tail_is_the_end_of_the_last_traceback(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text(TRACEBACK)
    tail = causes.error_tail(str(log))
    assert tail[-1] == "RuntimeError: Split sizes doesn't match total dim 0 size", tail
    assert tail[0] == "Traceback (most recent call last):" and len(tail) == causes.TAIL_LINES, tail
    assert len(causes.error_tail(str(log), lines=2)) == 2  # its last lines only: the last frame's code and why
    log.write_text("plain line\n\nlast words\n")
    assert causes.error_tail(str(log)) == ["plain line", "last words"]
    assert causes.error_tail(str(tmp_path / "missing.log")) == []


def test_a_hidden_rank_gets_its_last_lines_and_its_exception_in_the_line(tmp_path, capsys):
    log = tmp_path / "stderr.log"
    log.write_text(TRACEBACK)
    failures = {1: _failure(1, local_rank=1)}
    line, status = supervisor.failure_line(failures, [], {1: str(log)})
    assert status == 1 and line.startswith(
        "titan: error: rank 1 exited with status 1: RuntimeError: Split sizes doesn't match total dim 0 size"
    ), line
    context = supervisor.hidden_context(failures, {1: str(log)})
    assert context[-1] == "[rank1]:     out = all_to_all(x, splits)", context
    # the exception line is printed once: in the line, not among the context lines
    assert not any("RuntimeError" in c for c in context)
    # shown on the console already: the line points there instead of repeating it
    assert supervisor.failure_line(failures, [], {})[0].endswith("its output above says why")
    assert supervisor.hidden_context(failures, {}) == []
    # a rank with a titan line: the line is that, the launcher prints no context
    own = {1: _failure(2, "titan: error on rank 1: x", local_rank=1)}
    assert supervisor.hidden_context(own, {1: str(log)}) == [] and supervisor.failure_line(own, [], {1: str(log)})[0]


def test_the_policy_prints_the_context_once_per_failed_attempt(tmp_path, capsys):
    log = tmp_path / "stderr.log"
    log.write_text(TRACEBACK)
    failures = {1: _failure(1, local_rank=1)}
    policy = restarts.RestartPolicy(0, lambda f: ("titan: error: x", 1), lambda: False, lambda f: ["[rank1]: ctx"])
    assert policy.on_failure(failures, remaining=0) == 0
    assert capsys.readouterr().err.splitlines() == ["[rank1]: ctx"]
    # which failed ranks the console did not show: torchrun's files minus its tee'd ones
    pcontext = SimpleNamespace(stderrs={0: "/l/0/stderr.log", 1: str(log)}, tee_stderrs={0: "/l/0/stderr.log"})
    both = {0: _failure(1, local_rank=0), 1: _failure(1, local_rank=1)}
    assert restarts._hidden_outputs(pcontext, both) == {1: str(log)}
    assert restarts._hidden_outputs(SimpleNamespace(stderrs={0: "", 1: ""}, tee_stderrs={}), both) == {}


def test_a_sigkill_is_out_of_memory_only_when_the_kernel_counted_one():
    failures = {1: _failure(-9, pid=42)}
    line, status = supervisor.failure_line(failures, [], None, (3, 3))
    assert status == 137 and "out of memory" not in line and "outside titan" in line, line
    line, _ = supervisor.failure_line(failures, [], None, (None, None))
    assert "out of memory" not in line, line
    line, _ = supervisor.failure_line(failures, [], None, (3, 4))
    assert "out-of-memory killer ended 1 process(es)" in line, line
    # another signal: what it was, no cause guessed
    line, _ = supervisor.failure_line({1: _failure(-signal.SIGSEGV, pid=42)}, [], None, (3, 3))
    assert line.endswith("was killed by SIGSEGV; the other ranks stopped with it"), line


def test_oom_kill_count_reads_the_memory_cgroup(tmp_path, monkeypatch):
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 5\n")
    monkeypatch.setattr(causes, "_cgroup_files", lambda: [tmp_path / "absent", events])
    assert causes.oom_kill_count() == 5
    monkeypatch.setattr(causes, "_cgroup_files", lambda: [])
    assert causes.oom_kill_count() is None


def test_world_size_from_torchruns_options():
    assert supervisor.world_size(["--nproc_per_node", "2", "train.py", "--nnodes", "9"]) == 2
    assert supervisor.world_size(["--nnodes=2", "--nproc-per-node=4", "train.py"]) == 8
    assert supervisor.world_size(["--nnodes", "2:2", "--nproc_per_node", "3", "train.py"]) == 6
    assert supervisor.world_size(["--nnodes", "1:4", "train.py"]) is None  # elastic: the ranks check it
    assert supervisor.world_size(["train.py"]) == 1
    assert supervisor.world_size(["--nproc_per_node", "cpu", "train.py"]) >= 1


def test_the_launcher_checks_the_layout_for_its_world_and_marks_the_ranks(monkeypatch, capsys):
    monkeypatch.delenv(CHECKED_ENV, raising=False)
    monkeypatch.setattr(supervisor, "_torchrun", lambda argv, first=None: pytest.fail("torchrun started"))
    argv = ["--nproc_per_node", "3", "train.py", "--parallelism.tensor_parallel_degree", "2"]
    assert supervisor.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world size 3" in err[0], err
    standbys = []  # the prestarted ranks a torchrun that starts none leaves: the launcher stops them
    monkeypatch.setattr(supervisor, "_torchrun", lambda argv, first=None: standbys.extend(first.started()) or 0)
    assert supervisor.main(["--nproc_per_node", "2", "train.py", "--training.steps", "3"]) == 0
    assert len(standbys) == 2 and all(p.poll() is not None for p in standbys)
    import os

    assert os.environ[CHECKED_ENV] == "1"


def test_check_world_size_option(capsys):
    assert check.main(["--world_size", "x"]) == 2
    assert "--world_size needs the number of ranks" in capsys.readouterr().err


def test_a_rank_under_titans_launcher_leaves_its_line_to_it(tmp_path, monkeypatch, capsys):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TITAN_LAUNCHER_PID", "12345")
    assert report.exit_status(lambda: (_ for _ in ()).throw(TitanError("bad")), debug=lambda: False) == 2
    assert capsys.readouterr().err == ""  # the launcher prints it, last and once
    assert json.loads(path.read_text())["message"] == "titan: error: bad"
    monkeypatch.delenv("TITAN_LAUNCHER_PID")  # plain torchrun: rank 0 prints it itself
    monkeypatch.setenv("RANK", "0")
    assert report.exit_status(lambda: (_ for _ in ()).throw(TitanError("bad")), debug=lambda: False) == 2
    assert capsys.readouterr().err.strip() == "titan: error: bad"
