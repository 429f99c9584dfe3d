"""A standby process: imports torch and titan, warms up on the ranks' command line, then waits on
its standard input for a rank's assignment (its command line after the interpreter, environment
and output files) and runs it in this process. Started as ``python -m titan.launch.standby_process``
or forked from the zygote (titan.launch.zygote); the launcher's side is titan.launch.standby.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from titan.training.goodput import STARTED_AT_ENV, process_start_time

FIRST_ENV = "TITAN_FIRST_STANDBY"  # set on a standby started for the first attempt
STANDBY_NAME = "titan-standby"  # a waiting standby's process name (ps, /proc/<pid>/comm) ...
RANK_NAME = "titan-rank"  # ... and its name once it is a rank
MODULE = "titan.launch.standby_process"
PRELOAD = ("torch", "torch.distributed", "titan.training.trainer", "titan.launch.entry")
PR_SET_PDEATHSIG = 1


def prctl(option: int, value: int) -> bool:
    """Linux's prctl(option, value); False where it failed or does not exist."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _redirect(path: str | None, fd: int, saved: int) -> None:
    if path:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    else:
        os.dup2(saved, fd)


def _run(argv: list[str]) -> None:
    """Run the rank's command line (what follows the interpreter) in this process."""
    import runpy

    if argv and argv[0] == "-u":
        argv = argv[1:]
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[attr-defined]
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def set_name(name: str) -> None:
    """The process's name (its main thread's, which ps and /proc/<pid>/stat show), from any thread."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def _warm(argv: list[str]) -> None:
    """The read-only start of a rank of this command line, once: its config, its checks (files
    read, nothing written), its model on the meta device. What they import and read is then in
    place when the standby becomes a rank. Nothing here touches a GPU (a rank may see other ones)."""
    import warnings

    import torch

    from titan.config import load_config
    from titan.training.checks import check_job

    args = argv[1:] if argv[:1] == ["-u"] else argv
    args = args[2:] if args[:1] == ["-m"] else args[1:]
    with warnings.catch_warnings():  # a rank's own warnings show again in its log
        warnings.simplefilter("ignore")
        world = os.environ.get("WORLD_SIZE", "")
        plan = check_job(load_config(args), int(world) if world.isdigit() else None, "cpu", once=True)
        if plan is not None:
            with torch.device("meta"):
                plan.spec.model_cls(plan.model_args)


def quiet() -> tuple[int, int]:
    """Standard output and error to /dev/null until a rank's assignment says where (an import's
    warnings would reach the console unprefixed, outside any rank's log); returns the originals."""
    saved = (os.dup(1), os.dup(2))
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    return saved


def preload(argv: list[str], assigned: threading.Event | None = None) -> None:
    """The imports, and the warm-up on the ranks' command line unless an assignment came first."""
    import importlib

    try:
        for name in PRELOAD:
            importlib.import_module(name)
        if argv and not (assigned is not None and assigned.is_set()):
            _warm(argv)
    except Exception:  # the rank does it again and reports it
        pass


class Assignment:
    """The rank's assignment, read from standard input on a thread (EOF without one: no rank)."""

    def __init__(self) -> None:
        self.job: dict[str, Any] = {}
        self.ready = threading.Event()
        threading.Thread(target=self._read, name="titan-standby", daemon=True).start()

    def _read(self) -> None:
        data = sys.stdin.buffer.read()
        if data:
            self.job.update(json.loads(data))
            set_name(RANK_NAME)  # a rank from now on
        self.ready.set()


def wait_and_run(first_start: float | None, saved: tuple[int, int], assignment: Assignment | None = None) -> int:
    """Wait for the assignment, then run the rank in this process with its environment and files."""
    assignment = assignment or Assignment()
    assignment.ready.wait()
    job = assignment.job
    if not job:
        return 0  # the launcher closed its end: no more restarts
    os.environ.clear()
    os.environ.update(job["env"])
    os.environ[STARTED_AT_ENV] = repr(first_start if first_start is not None else time.time())
    _threads_as_the_environment_says()
    _redirect(job["stdout"], 1, saved[0])
    _redirect(job["stderr"], 2, saved[1])
    _run(job["argv"])
    return 0


def _threads_as_the_environment_says() -> None:
    """OpenMP read OMP_NUM_THREADS when torch was imported, before this rank's environment (where
    torchrun sets it) existed: the rank would otherwise run a thread per core of the node."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def main(argv: list[str]) -> int:
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # gone with the launcher
    set_name(STANDBY_NAME)
    # A first-attempt rank started when the launcher did: its start-up counts from here (goodput).
    first_start = process_start_time() if os.environ.get(FIRST_ENV) == "1" else None
    saved = quiet()
    assignment = Assignment()
    preload(argv, assignment.ready)
    return wait_and_run(first_start, saved, assignment)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
