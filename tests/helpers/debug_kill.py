"""Fault injection for tests: SIGKILL (or fail) a training process at a chosen moment.

``TITAN_DEBUG_KILL_AT`` names the moment: ``step=K`` (right after training step K, before its
save) or ``save:step=K`` (during the save of step K: every rank's files and DCP's ``.metadata``
are written, the ``COMPLETE`` marker is not). Every rank that reaches the point kills itself,
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

titan itself knows nothing of this: ``install()`` wraps the checkpoint manager's step hook and
commit from the outside. A subprocess (train.py, torchrun, Slurm) gets it through ``kill_env``,
which puts ``tests/helpers/kill_site`` (a ``sitecustomize`` that calls ``install()``) on its
PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from titan.errors import TitanError
from titan.log import logger

ENV = "TITAN_DEBUG_KILL_AT"
READY_ENV, WAIT_ENV = "TITAN_DEBUG_READY_FILE", "TITAN_DEBUG_WAIT_AT"
GATE_TIMEOUT_S = 240.0
SITE = Path(__file__).resolve().parent / "kill_site"


class DebugKill:
    """The kill point of ``spec`` (default: the environment's) for this process."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get(ENV, "") if spec is None else spec
        self.point, self.step, self.error = None, -1, False
        if spec:
            m = re.fullmatch(r"(?:(save|error|sync):)?step=(\d+)(?:@rank(\d+))?(?:@attempt(\d+))?", spec.strip())
            if not m:
                raise TitanError(f"{ENV}={spec!r}; valid: [save:|error:|sync:]step=K[@rankR][@attemptA]")
            if m[3] is not None and int(os.environ.get("RANK", "0")) != int(m[3]):
                return  # another rank is the one that fails
            if m[4] is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != int(m[4]):
                return  # another attempt is the one that fails
            self.error = m[1] == "error"
            self.point, self.step = ("step" if m[1] in (None, "error") else m[1]), int(m[2])

    def __call__(self, point: str, step: int) -> None:
        if self.point == point and self.step == step and self.error:
            raise TitanError(f"{ENV}: injected failure after step {step}")
        if self.point == point and self.step == step:
            logger.warning(f"{ENV}: SIGKILL at {point} of step {step}")
            for h in logger.handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def install(kill: DebugKill | None = None) -> None:
    """Wrap CheckpointManager.after_step (the ``step`` point) and its commit (the ``save`` point:
    after DCP and the manifest, before the marker) with ``kill``."""
    from titan.checkpointing.manager import CheckpointManager

    kill = DebugKill() if kill is None else kill
    install_replica_gates(kill)
    if kill.point is None:
        return
    after_step, commit = CheckpointManager.after_step, CheckpointManager._commit

    def after_step_then_kill(self: CheckpointManager, step: int) -> bool:
        kill("step", step)
        return after_step(self, step)

    def commit_then_kill(self: CheckpointManager, step: int, path: str, model_only: bool, t0: float) -> None:
        kill("save", step)
        commit(self, step, path, model_only, t0)

    CheckpointManager.after_step = after_step_then_kill  # type: ignore[method-assign]
    CheckpointManager._commit = commit_then_kill  # type: ignore[method-assign]


def install_replica_gates(kill: DebugKill) -> None:
    """The ``sync`` kill point and the ready / wait gates on titan.ft's ReplicaGroups (when torchft
    is there)."""
    try:
        from titan.ft.replicas import ReplicaGroups
    except ImportError:
        return
    import time

    start_step, sync_gradients = ReplicaGroups.start_step, ReplicaGroups.sync_gradients
    ready = os.environ.get(READY_ENV, "")
    waits = {int(k): f for k, f in re.findall(r"step=(\d+):([^,]+)", os.environ.get(WAIT_ENV, ""))}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    first = [True]

    def start_step_gated(self: ReplicaGroups) -> None:
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
