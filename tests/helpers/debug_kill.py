"""Fault injection for tests: SIGKILL (or fail, or pause) a process at a chosen moment, so a test
acts on an event of the run instead of racing a timer against it.

``TITAN_DEBUG_KILL_AT`` names the moment: ``step=K`` (right after training step K: its interval
save and its line done, before the ranks agree on a signal and its in-memory snapshot) or
``save:step=K`` (during the save of step K: every rank's files and DCP's ``.metadata``
are written, the ``COMPLETE`` marker is not) or ``snapshot:step=K`` (during the in-memory snapshot
of step K: its data is copied, its manifest not written). Every rank that reaches the point kills itself,
exactly like ``kill -9``; ``@rankR`` limits it to global rank R, ``@attemptA`` to torchrun's
restart A (``TORCHELASTIC_RESTART_COUNT``, 0 for the first). ``error:step=K`` raises a TitanError
after step K instead (a rank failing while the others wait in a collective). ``sync:step=K``
kills inside step K of a replica group, after its backward and before its gradients are
averaged with the other groups (so they see the group vanish mid-step).

Replica-group gates (titan/ft/): with ``TITAN_DEBUG_READY_FILE=<prefix>`` every attempt creates
``<prefix>.<A>`` (A: torchrun's restart count) as it begins its first step, i.e. with its torchft
manager up and about to ask for a quorum; ``TITAN_DEBUG_WAIT_AT=step=K:<file>[,step=K:<file>]``
holds a group before its step K until that file exists. A peer's (re)start is so ordered against
the group's steps by an event, not by a timer.

Points that pause instead of killing, for a test that must act while the run is at a known place:
``hold:step=K`` waits after step K (its line logged, before the save a signal asks for) until the run's preemption
handler got a signal (SIGTERM, SIGUSR1: checkpointing on), so a run the test signals there cannot
have finished first; ``stop:committed=K`` stops the process (SIGSTOP) right after the save of step K is committed; the
test sees it stopped (``wait_stopped``), acts, and continues it with SIGCONT.
``interrupt:shard=K`` is for scripts/tokenize_dataset.py: once shard K (0-based) is written, the
tokenizing process gets SIGINT, as from Ctrl-C (from whichever process wrote the shard).

titan itself knows nothing of this: ``install()`` wraps the checkpoint manager's step hook and
commit, the snapshots' data hook (or the tokenizer's shard writer) from the outside. The rank and
attempt filters are read when the point is reached, not at install: a warm standby
(titan/launch/standby.py) installs it before it knows its rank. A subprocess (train.py, torchrun, Slurm,
tokenize_dataset.py and its worker processes) gets it through ``kill_env``, which puts
``tests/helpers/kill_site`` (a ``sitecustomize`` that calls ``install()``) on its PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import select
import signal
import time
from pathlib import Path
from typing import Any

from titan.errors import TitanError
from titan.log import logger

ENV = "TITAN_DEBUG_KILL_AT"
READY_ENV, WAIT_ENV = "TITAN_DEBUG_READY_FILE", "TITAN_DEBUG_WAIT_AT"
GATE_TIMEOUT_S = 240.0
SITE = Path(__file__).resolve().parent / "kill_site"
_SPEC = re.compile(
    r"(?:(?:(save|error|hold|sync|snapshot):)?step=(\d+)|stop:committed=(\d+)|interrupt:shard=(\d+))"
    r"(?:@rank(\d+))?(?:@attempt(\d+))?"
)
VALID = "[save:|error:|hold:|sync:|snapshot:]step=K, stop:committed=K or interrupt:shard=K, then [@rankR][@attemptA]"


class DebugKill:
    """The kill point of ``spec`` (default: the environment's) for this process."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.point: str | None = None
        self.step, self.error = -1, False
        self.rank = self.attempt = None
        if spec:
            m = _SPEC.fullmatch(spec.strip())
            if not m:
                raise TitanError(f"{ENV}={spec!r}; valid: {VALID}")
            # another rank / attempt is the one that fails: decided when the point is reached
            self.rank = int(m[5]) if m[5] is not None else None
            self.attempt = int(m[6]) if m[6] is not None else None
            if m[3] is not None:
                self.point, self.step = "committed", int(m[3])
            elif m[4] is not None:
                self.point, self.step = "shard", int(m[4])
            else:
                self.error = m[1] == "error"
                self.point, self.step = ("step" if m[1] in (None, "error") else m[1]), int(m[2])

    def here(self) -> bool:
        """Whether this process (its rank, its attempt) is the one the spec names."""
        if self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank:
            return False
        return self.attempt is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == self.attempt

    def __call__(self, point: str, step: int) -> None:
        if self.point != point or self.step != step or not self.here():
            return
        if self.error:
            raise TitanError(f"{ENV}: injected failure after step {step}")
        if point == "committed":
            _flush()
            os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it
            return
        if point == "shard":
            logger.warning(f"{ENV}: SIGINT after shard {step}")
            _flush()
            os.kill(_tokenizing_process(), signal.SIGINT)
            return
        logger.warning(f"{ENV}: SIGKILL at {point} of step {step}")
        _flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _flush() -> None:
    for h in logger.handlers:
        h.flush()


def _tokenizing_process() -> int:
    """The process that reads the documents: this one, or the parent of a tokenizer worker."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    return os.getpid() if parent is None or parent.pid is None else parent.pid


def install(kill: DebugKill | None = None) -> None:
    """Wrap CheckpointManager.after_step (the ``step`` point) and its commit (the ``save`` point:
    after DCP and the manifest, before the marker; the ``committed`` point: after the marker), or
    the tokenizer's shard writer (the ``shard`` point), with ``kill``."""
    kill = DebugKill() if kill is None else kill
    install_replica_gates(kill)
    if kill.point is None:
        return
    if kill.point == "shard":
        from titan.data import tokenize

        # The SIGINT must arrive as a terminal's Ctrl-C does. A test run may have SIGINT ignored
        # (pytest started as a background job of a non-interactive shell, some CI runners): an
        # ignored disposition survives exec, Python then installs no KeyboardInterrupt handler,
        # and the script would tokenize to the end instead. (The workers ignore it again.)
        signal.signal(signal.SIGINT, signal.default_int_handler)

        encode = tokenize._encode_shard

        def encode_then_interrupt(tokenizer: Any, folder: str, index: int, texts: list[str], dtype: str) -> dict:
            entry = encode(tokenizer, folder, index, texts, dtype)
            kill("shard", index)
            return entry

        tokenize._encode_shard = encode_then_interrupt
        return
    from titan.checkpointing.manager import CheckpointManager
    from titan.checkpointing.memory_snapshot import MemorySnapshots

    after_step, commit = CheckpointManager.after_step, CheckpointManager._commit
    data_written = MemorySnapshots.data_written

    def after_step_then_kill(self: CheckpointManager, step: int) -> bool:
        kill("step", step)
        if kill.point == "hold" and kill.step == step and kill.here():
            _hold(self, step)
        return after_step(self, step)

    def data_written_then_kill(self: MemorySnapshots, step: int) -> None:
        data_written(self, step)
        kill("snapshot", step)

    def commit_then_kill(self: CheckpointManager, step: int, path: str, model_only: bool, t0: float) -> None:
        kill("save", step)
        commit(self, step, path, model_only, t0)
        kill("committed", step)

    CheckpointManager.after_step = after_step_then_kill  # type: ignore[method-assign]
    CheckpointManager._commit = commit_then_kill  # type: ignore[method-assign]
    MemorySnapshots.data_written = data_written_then_kill  # type: ignore[method-assign]


def _hold(manager: Any, step: int) -> None:
    watcher = manager.watcher
    if watcher is None:
        raise TitanError(f"{ENV}=hold:step={step} needs checkpoint.enable (its signal handler)")
    logger.warning(f"{ENV}: holding after step {step} until a signal")
    _flush()
    while watcher.received is None:  # an event, not a deadline: the run stays here until signalled
        time.sleep(0.05)


def wait_stopped(pid: int) -> None:
    """Block until the child ``pid`` is stopped (a ``stop:`` point) or has exited; the kernel tells
    waitpid, no polling. A stopped child is left unreaped for its Popen to wait on later."""
    os.waitid(os.P_PID, pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)


def wait_gone(pid: int, timeout: float) -> bool:
    """Block until ``pid`` (any process, not only a child) has exited, or ``timeout`` (a guard
    against a hang) has passed; True when it exited. The kernel signals its pidfd: no polling."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def install_replica_gates(kill: DebugKill) -> None:
    """The ``sync`` kill point and the ready / wait gates on titan.ft's ReplicaGroups (when torchft
    is there)."""
    try:
        from titan.ft.replicas import ReplicaGroups
    except ImportError:
        return

    start_step, sync_gradients = ReplicaGroups.start_step, ReplicaGroups.sync_gradients
    first = [True]

    def start_step_gated(self: ReplicaGroups) -> None:
        # read here, not at install: a warm standby learns its environment after it
        ready = os.environ.get(READY_ENV, "")
        waits = {int(k): f for k, f in re.findall(r"step=(\d+):([^,]+)", os.environ.get(WAIT_ENV, ""))}
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if ready and first[0]:
            Path(f"{ready}.{attempt}").touch()
            first[0] = False
        path = waits.get(self._train_step)
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while path and not os.path.exists(path):  # an event from the peer; the deadline ends a broken test
            if time.monotonic() > deadline:
                raise TitanError(f"{WAIT_ENV}: {path} did not appear")
            time.sleep(0.05)
        start_step(self)

    def sync_then_kill(self: ReplicaGroups, params: list) -> bool:
        kill("sync", self._train_step)
        return sync_gradients(self, params)

    ReplicaGroups.start_step = start_step_gated  # type: ignore[method-assign]
    ReplicaGroups.sync_gradients = sync_then_kill  # type: ignore[method-assign]


def kill_env(spec: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``TITAN_DEBUG_KILL_AT`` and a PYTHONPATH that installs it in every Python process started
    with this environment (added to ``env``, default os.environ, or returned alone for **-merging)."""
    base = os.environ if env is None else env
    path = os.pathsep.join(p for p in (str(SITE), base.get("PYTHONPATH", "")) if p)
    return {ENV: spec, "PYTHONPATH": path}
