"""Warm restarts: ranks that start with torch and titan already imported.

With ``--max-restarts N`` the launcher keeps two standby processes per local rank (a failure in
the middle of a restart finds the second): processes that have imported torch, torch.distributed
and titan's trainer and wait for work on their standard input. They are forks of one warm process
(titan.launch.zygote), so a new one costs milliseconds and no CPU, and the pool refills as soon as
the ranks it gave out have started; where forks are not available, each is its own
``python -m titan.launch.standby`` interpreter (seconds of CPU), started a few seconds after the
ranks it replaces so that its imports do not slow their start-up. When torchrun restarts the
ranks, each new rank is a standby handed its assignment (the rank's command line after the
interpreter, its environment, its output files) instead of a fresh interpreter: it pays neither
the imports nor their CPU while the others wait.

torchrun keeps doing everything else (rendezvous, monitoring, stopping): the launcher hands its
process context a handler holding the standby's process instead of a new one
(``rank_process``), only for titan's own entry point (``train.py`` or ``-m titan.train``). Each
rank's handler also notes when its process ended, so the next attempt's goodput record can tell
detection from restart. A standby names itself ``titan-standby`` while it waits and
``titan-rank`` once it is a rank (ps shows them so; the launcher forwards signals to ranks only).
``TITAN_WARM_RESTARTS=N`` keeps N standbys per local rank (0: none, fresh interpreters).

The first attempt's ranks are standbys too (``TITAN_PRESTART=0``: fresh interpreters): the
launcher starts the warm process as soon as the config has parsed, so the imports of torch and
titan (seconds of CPU, once per node) overlap the launcher's own config check instead of
following it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from titan.launch.standby_process import FIRST_ENV, MODULE, RANK_NAME, STANDBY_NAME
from titan.launch.zygote import ZYGOTE_NAME, Zygote, supported

WARM_ENV = "TITAN_WARM_RESTARTS"
PRESTART_ENV = "TITAN_PRESTART"  # 0: the first attempt's ranks start as fresh interpreters
REFILL_DELAY_S = 5.0
STOP_GRACE_S = 1.0


def is_rank(pid: int, comm: str) -> bool:
    """Whether a child process of the launcher is a rank: not a standby, or a standby that took a
    rank's assignment (it renames itself then; one just started has the interpreter's name)."""
    if comm == RANK_NAME:
        return True
    if comm in (STANDBY_NAME, ZYGOTE_NAME):  # forked standbys carry the zygote's command line
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return MODULE.encode() not in f.read()
    except OSError:
        return False


def titan_entry(args: tuple) -> bool:
    """Whether a rank's arguments (after the interpreter) run titan's entry point."""
    rest = [str(a) for a in args]
    if rest and rest[0] == "-u":
        rest = rest[1:]
    if rest[:2] == ["-m", "titan.train"]:
        return True
    return bool(rest) and os.path.basename(rest[0]) == "train.py"


class StandbyPool:
    """This launcher's standby processes, one per local rank it has started. They are forks of one
    warm process (titan.launch.zygote): a new one costs milliseconds, so the pool refills as soon as
    the ranks start. Where forks are not available they start as interpreters, ``delay`` seconds
    after the ranks they replace (the first ones after the first ranks), so that their imports do
    not compete with the new ranks' own start-up for the CPU."""

    def __init__(self, delay: float = REFILL_DELAY_S, per_rank: int = 1) -> None:
        self.size, self.delay, self.per_rank = 0, delay, per_rank
        self.args: tuple = ()  # the ranks' command line (after the interpreter): standbys warm up on it
        self.world_size = ""  # ... for this many ranks
        self.ready: list[Any] = []  # subprocess.Popen, or zygote.Forked (the same interface)
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False
        self._zygote: Zygote | None = None
        self._starting: threading.Thread | None = None

    def _env(self) -> dict[str, str]:
        return {**os.environ, "WORLD_SIZE": self.world_size} if self.world_size else dict(os.environ)

    def _spawn(self, first: bool = False) -> Any:  # noqa: ANN401 - Popen or Forked
        if supported():
            if self._zygote is None:
                self._zygote = Zygote(self.args, self._env())
            proc = self._zygote.spawn(first)
            if proc is not None or self._closed:
                return proc
        env = self._env()
        if first:
            env[FIRST_ENV] = "1"
        return subprocess.Popen(
            [sys.executable, "-m", MODULE, *self.args],
            stdin=subprocess.PIPE,
            env=env,
            start_new_session=True,  # as torchrun's own ranks: signalled by process group
        )

    def _add(self, first: bool) -> None:
        proc = self._spawn(first)
        if proc is not None:
            self.ready.append(proc)

    def fill(self) -> None:
        with self._lock:
            self.ready = [p for p in self.ready if p.poll() is None]
            while len(self.ready) < self.size * self.per_rank and not self._closed:
                self._add(first=False)

    def start(self) -> None:
        """One standby per local rank, for the first attempt (before torchrun asks for them); the
        forks wait for the zygote's imports on a thread, which the caller's check overlaps."""
        if supported() and self._zygote is None:
            self._zygote = Zygote(self.args, self._env())

        def spawn_all() -> None:
            with self._lock:
                for _ in range(self.size):
                    if not self._closed:
                        self._add(first=True)

        self._starting = threading.Thread(target=spawn_all, name="titan-first-standbys", daemon=True)
        self._starting.start()

    def kill(self) -> None:
        """Stop every standby at once: no rank will start (the config check failed)."""
        self._closed = True
        if self._zygote is not None:
            self._zygote.proc.kill()  # a fork it is still importing for fails at once
        with self._lock:
            for proc in self.ready:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            self.ready = []
            self._close_zygote()

    def fill_later(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(0.0 if self._zygote is not None else self.delay, self.fill)
        self._timer.daemon = True
        self._timer.start()

    def started(self) -> list[Any]:
        """The standbys waiting, once the first ones asked for by ``start`` exist."""
        if self._starting is not None:
            self._starting.join()
        return list(self.ready)

    def take(self) -> Any:  # noqa: ANN401 - Popen, Forked or None
        self.started()
        with self._lock:
            while self.ready:
                proc = self.ready.pop(0)
                if proc.poll() is None:
                    return proc
        return None

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            for proc in self.ready:
                try:
                    assert proc.stdin is not None
                    proc.stdin.close()  # EOF: the standby exits
                    proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()
            self.ready = []
            self._close_zygote()

    def _close_zygote(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


def _watch_exit(handler: Any) -> None:
    """Note when the handler's process ends (``titan_exited_at``), without reaping it (torchrun's
    poll does)."""
    handler.titan_exited_at = None
    pid = handler.proc.pid

    def wait() -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        handler.titan_exited_at = time.time()

    threading.Thread(target=wait, name=f"titan-exit-{pid}", daemon=True).start()


class StandbyHandler:
    """What torchrun's SubprocessContext holds per rank (its SubprocessHandler's interface), around
    a standby process that took the rank's assignment."""

    def __init__(
        self,
        proc: subprocess.Popen,
        args: tuple,
        env: dict[str, str],
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
    ) -> None:
        self.proc, self.local_rank_id = proc, local_rank_id
        self._stdout = self._stderr = None
        job = {"argv": [str(a) for a in args], "env": {**os.environ, **env}, "stdout": stdout, "stderr": stderr}
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except OSError:  # it died meanwhile: torchrun sees it failed and restarts
            pass

    def close(self, death_sig: signal.Signals | None = None) -> None:
        try:
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
        except ProcessLookupError:
            pass


def _kill_after_grace(handler: Any) -> None:
    """torchrun stops the other ranks of a failed attempt with SIGTERM and waits for them (up to
    its shutdown timeout): they only tear down a process group that lost a member. After
    ``STOP_GRACE_S`` they are killed, so a slow teardown does not delay the restart."""
    close = handler.close

    def close_then_kill(death_sig: signal.Signals | None = None) -> None:
        close(death_sig)
        if death_sig in (None, signal.SIGTERM):

            def kill() -> None:
                if handler.proc.poll() is None:
                    try:
                        os.killpg(handler.proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

            timer = threading.Timer(STOP_GRACE_S, kill)
            timer.daemon = True
            timer.start()

    handler.close = close_then_kill


def rank_process(pool: StandbyPool | None, original: Callable[..., Any]) -> Callable[..., Any]:
    """torchrun's ``get_subprocess_handler``, taking a standby for titan's entry point; with
    restarts, the other ranks of a failed attempt get STOP_GRACE_S to end."""

    def handler(
        entrypoint: str,
        args: tuple,
        env: dict[str, str],
        stdout: str,
        stderr: str,
        local_rank_id: int,
        numa_options: Any = None,
    ) -> Any:
        eligible = pool is not None and entrypoint == sys.executable and titan_entry(args) and numa_options is None
        proc = pool.take() if pool is not None and eligible else None
        if proc is None:
            out = original(
                entrypoint=entrypoint,
                args=args,
                env=env,
                stdout=stdout,
                stderr=stderr,
                local_rank_id=local_rank_id,
                numa_options=numa_options,
            )
        else:
            out = StandbyHandler(proc, args, env, stdout, stderr, local_rank_id)
        _watch_exit(out)
        if pool is not None and pool.per_rank:  # restarts: the next standbys
            _kill_after_grace(out)
            pool.size = max(pool.size, local_rank_id + 1)
            pool.args = tuple(str(a) for a in args) if titan_entry(args) else ()
            pool.world_size = env.get("WORLD_SIZE", "")
            pool.fill_later()
        return out

    return handler


def standbys_per_rank(max_restarts: int) -> int:
    """Standbys the launcher keeps per local rank: TITAN_WARM_RESTARTS (default 2), none without restarts."""
    value = os.environ.get(WARM_ENV, "2")
    return int(value) if max_restarts > 0 and value.isdigit() else 0


def first_ranks(nproc_per_node: str | None) -> StandbyPool | None:
    """The pool for the first attempt's ranks (``start`` it once the config parses), or None: with
    TITAN_PRESTART=0, or when torchrun counts the ranks itself (--nproc_per_node gpu / auto)."""
    nproc = nproc_per_node or "1"
    if os.environ.get(PRESTART_ENV, "1") == "0" or not nproc.isdigit():
        return None
    pool = StandbyPool(per_rank=0)
    pool.size = int(nproc)
    return pool
