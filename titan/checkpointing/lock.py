"""One writer per dump folder: ``<job.dump_folder>/.titan.lock``.

Rank 0 creates the file with O_EXCL before anything of the run is written (metrics, TensorBoard,
checkpoints) and removes it when the run ends, with the dump folder if the lock made it and the
run left it empty. It records pid, host and the process start time
(from /proc, so a recycled pid is not mistaken for the old run). A lock left by a process that no
longer exists on this host is stale: it is taken over with a warning. A lock from another host
cannot be checked from here, so it is reported and the user decides.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time

from titan.errors import TitanError
from titan.log import logger

LOCK_NAME = ".titan.lock"


def process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc (macOS): alive or not, without a start time
        except ProcessLookupError:
            return None
        except PermissionError:
            return ""
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 counted after the command name


def _describe(info: dict) -> str:
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started', '?')}"


class RunLock:
    def __init__(self, dump_folder: str) -> None:
        self.path = os.path.join(dump_folder, LOCK_NAME)
        self.mine: dict | None = None
        self.made: list[str] = []  # the folders acquire created, deepest first

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written right now, or garbage: judged by its age below

    def _is_stale(self, info: dict) -> bool:
        if not info:  # unreadable: stale only if nobody wrote it for a while
            try:
                return time.time() - os.path.getmtime(self.path) > 60
            except OSError:
                return True
        if info.get("host") != socket.gethostname():
            return False
        alive = process_start(int(info.get("pid", -1)))
        return alive is None or (alive != "" and alive != info.get("start_ticks"))

    def acquire(self) -> None:
        folder = os.path.abspath(os.path.dirname(self.path) or ".")
        while not os.path.exists(folder):
            self.made.append(folder)
            folder = os.path.dirname(folder)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start_ticks": process_start(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                info = self._read()
                if info is None:
                    continue  # released between our open and read: try again
                same = {k: info.get(k) for k in ("pid", "host", "start_ticks")} == {
                    k: me[k] for k in ("pid", "host", "start_ticks")
                }
                if same:  # this very process (a second Trainer in one interpreter, e.g. tests)
                    self.mine = info
                    return
                if not self._is_stale(info):
                    raise TitanError(
                        f"job.dump_folder {os.path.dirname(self.path)} is in use by another run ({_describe(info)});"
                        f" wait for it to end, stop it, or use another job.dump_folder (if that run is gone,"
                        f" delete {self.path})"
                    ) from None
                logger.warning(
                    f"taking over the stale lock {self.path} of a run that no longer exists ({_describe(info)})"
                )
                try:  # rename, not unlink: of two runs taking over at once only one succeeds
                    os.rename(self.path, f"{self.path}.stale-{os.getpid()}")
                    os.remove(f"{self.path}.stale-{os.getpid()}")
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.mine = me
            atexit.register(self.release)
            return
        raise TitanError(f"could not take the lock {self.path} (other runs keep creating it)")

    def release(self) -> None:
        """Remove the lock if it is still ours (idempotent), and the folders acquire made if the run
        left them empty (it stopped before writing anything: a refused launch leaves nothing)."""
        if self.mine is None:
            return
        if self._read() == self.mine:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        self.mine = None
        for folder in self.made:
            try:
                os.rmdir(folder)
            except OSError:  # written to (or gone): keep it and its parents
                break
        self.made = []
