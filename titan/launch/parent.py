"""A rank stops when its launcher dies: no headless training.

torchrun starts every rank in its own session, so a signal to the launcher's process group (even
kill -9) never reaches the ranks; left alone they would train on unsupervised, writing checkpoints
that a restarted run then races with. So each rank watches its parent (the torchrun agent):
the kernel sends SIGTERM when it dies (PR_SET_PDEATHSIG, Linux) and a thread polls getppid() as a
portable backstop. SIGTERM is the preemption signal: the rank finishes its step, saves a checkpoint
and exits (titan/checkpointing/preemption.py). If it is still alive after the grace period (a rank
stuck in a collective whose peers are gone), it is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
# The pid of titan's launcher (python -m titan.launch), set for its ranks: a rank started after its
# launcher already died sees a different parent at once.
LAUNCHER_PID_ENV = "TITAN_LAUNCHER_PID"


def grace_seconds() -> float:
    """torchrun's own grace for a signalled rank (--shutdown_timeout reads the same variable)."""
    try:
        return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    except ValueError:
        return 30.0


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stop(parent: int, grace: float) -> None:
    print(
        f"titan: the launcher (pid {parent}) is gone: saving a checkpoint if one is configured, then"
        f" stopping (killed after {grace:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int, grace: float, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    _stop(parent, grace)


def watch_parent(poll_s: float = 0.5) -> None:
    """Call once, early, in a rank started by a launcher."""
    parent = os.getppid()
    grace = grace_seconds()
    _set_pdeathsig(signal.SIGTERM)
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if parent == 1 or (expected and expected.isdigit() and int(expected) != parent):
        # gone before the death signal was armed
        gone = int(expected) if expected and expected.isdigit() else parent
        threading.Thread(target=_stop, args=(gone, grace), daemon=True).start()
        return
    threading.Thread(target=_watch, args=(parent, grace, poll_s), name="titan-parent-watch", daemon=True).start()
