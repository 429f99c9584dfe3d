"""One warm process that the launcher's standbys are forked from.

A standby (titan.launch.standby_process) is a process that has imported torch and titan before it knows
its rank. Started as its own interpreter, each paid those imports (about 2 s of CPU and a few
hundred MB) whether or not it ever became a rank: two ranks and two standbys each for restarts
imported torch five times over on one node. Here one process, the zygote, imports and warms up once
and every standby is a fork of it: milliseconds and no CPU for the copy, its memory shared until
written. So the launcher keeps its standbys ready from the first second (a rank killed during the
first start-up is replaced warm too), and a launch pays the imports once per node, not per rank.

The zygote stays single-threaded (torch starts no Python thread on import) and only forks. Each
standby is forked twice (zygote -> helper -> standby, the helper exiting at once) so that it is
reparented to the launcher, which marks itself a child subreaper: the launcher waits for its
ranks' exit statuses itself (``Forked``), signals them and finds them among its children exactly as
it does processes it started. Linux only (prctl); elsewhere the standbys start as interpreters.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from titan.launch.standby_process import (
    PR_SET_PDEATHSIG,
    STANDBY_NAME,
    prctl,
    preload,
    quiet,
    set_name,
    wait_and_run,
)

MODULE = "titan.launch.zygote"
ZYGOTE_NAME = "titan-zygote"
_PR_SET_CHILD_SUBREAPER = 36


def supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(os, "fork")


class Forked:
    """A forked standby as the launcher sees it: subprocess.Popen's interface that the launcher and
    torchrun use (pid, stdin, poll, wait, send_signal, terminate, kill), on a child the launcher
    adopted (it waits for it with waitpid like any child)."""

    def __init__(self, pid: int, stdin: Any) -> None:
        self.pid, self.stdin, self.args = pid, stdin, [ZYGOTE_NAME]
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: nothing tells its status any more
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The launcher's end: starts the zygote (``args``: the ranks' command line after the
    interpreter, which it warms up on; ``env``: its environment) and asks it for standbys."""

    def __init__(self, args: tuple, env: dict[str, str]) -> None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1)
        self._sock, theirs = socket.socketpair()
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, str(theirs.fileno()), *args],
            env=env,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self._reply = self._sock.makefile("r")

    def spawn(self, first: bool) -> Forked | None:
        """A new standby (None if the zygote is gone: the caller starts an interpreter)."""
        read, write = os.pipe()
        try:
            with self._lock:
                socket.send_fds(self._sock, [json.dumps({"first": first}).encode() + b"\n"], [read])
                line = self._reply.readline()
        except OSError:
            line = ""
        finally:
            os.close(read)
        if not line.strip():
            os.close(write)
            return None
        return Forked(int(line), os.fdopen(write, "wb"))

    def close(self) -> None:
        """The zygote exits when its socket closes. Called once no forked standby or rank is left, so
        this process stops adopting orphans (an in-process caller lives on: a test, a notebook)."""
        try:
            self._reply.close()  # the socket's file: the socket closes with the last of them
            self._sock.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        prctl(_PR_SET_CHILD_SUBREAPER, 0)


# ---------------------------------------------------------------- the zygote process itself
def _fork_standby(sock: socket.socket, assignment: int, first_start: float | None, saved: tuple[int, int]) -> int:
    """Fork a standby through a helper that exits at once (the standby is reparented to the
    launcher, the subreaper); returns its pid."""
    pid_read, pid_write = os.pipe()
    helper = os.fork()
    if helper == 0:  # helper
        try:
            standby = os.fork()
            if standby == 0:
                os.close(pid_read)
                os.close(pid_write)
                _become_standby(sock, assignment, first_start, saved)  # never returns
            os.write(pid_write, str(standby).encode())
        finally:
            os._exit(0)
    os.close(pid_write)
    with os.fdopen(pid_read, "rb") as f:
        pid = int(f.read() or b"0")
    os.waitpid(helper, 0)
    return pid


def _become_standby(sock: socket.socket, assignment: int, first_start: float | None, saved: tuple[int, int]) -> None:
    status = 1
    try:
        sock.close()
        os.setsid()  # as torchrun's own ranks: signalled by process group
        os.dup2(assignment, 0)
        os.close(assignment)
        launcher = int(os.environ["TITAN_ZYGOTE_PARENT"])
        while os.getppid() not in (launcher, 1):  # the helper has exited: now the launcher's child
            time.sleep(0.001)
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # gone with the launcher
        if os.getppid() != launcher:
            os._exit(0)
        status = wait_and_run(first_start, saved)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve(fd: int, argv: list[str]) -> int:
    from titan.training.goodput import process_start_time

    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    set_name(ZYGOTE_NAME)
    os.environ["TITAN_ZYGOTE_PARENT"] = str(os.getppid())
    started = process_start_time()  # the first ranks' start-up counts from here: the launch
    saved = quiet()
    preload(argv)
    sock = socket.socket(fileno=fd)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        except OSError:
            return 0
        if not msg:
            return 0  # the launcher closed its end
        request = json.loads(msg)
        set_name(STANDBY_NAME)  # what the forked standby starts as
        pid = _fork_standby(sock, fds[0], started if request.get("first") else None, saved)
        set_name(ZYGOTE_NAME)
        os.close(fds[0])
        sock.sendall(f"{pid}\n".encode())


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), sys.argv[2:]))
