"""Replica groups as users launch them, for the tests: a real torchft lighthouse on localhost and
one titan launcher (torchrun) per group of one CPU rank, gloo between the groups."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.distributed import _free_port
from tests.helpers.runs import REPO, TINY_CKPT, run_env

STEPS = 9


@contextmanager
def lighthouse(min_replicas: int, *flags: str) -> Iterator[str]:
    """A lighthouse forming quorums of at least ``min_replicas`` groups; its address."""
    port = _free_port()
    cmd = ["torchft_lighthouse", "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://localhost:{port}"
    finally:
        proc.kill()
        proc.wait()


def group(lighthouse: str, folder: Path, replica: int, *args: str, env: dict[str, str], restarts: int = 0):
    """One replica group of one rank (of two), started as run_train.sh starts it: the tiny run for
    STEPS steps (``args`` override), console output in ``folder``/group<replica>.log."""
    cmd = [sys.executable, "-m", "titan.launch", "--nproc_per_node=1", "--rdzv_backend", "c10d"]
    cmd += ["--rdzv_endpoint=localhost:0", "--max-restarts", str(restarts), "train.py", *TINY_CKPT]
    cmd += ["--training.steps", str(STEPS), "--checkpoint.interval", "100"]
    cmd += ["--job.dump_folder", str(folder / f"r{replica}")]
    cmd += ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    cmd += ["--fault_tolerance.replica_id", str(replica), "--fault_tolerance.process_group_timeout_ms", "5000", *args]
    env = run_env(TORCHFT_LIGHTHOUSE=lighthouse, **env)
    log = open(folder / f"group{replica}.log", "w")  # noqa: SIM115 (read back by output())
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def output(proc: subprocess.Popen, folder: Path, replica: int, timeout: float) -> str:
    """The group's exit, then its whole console output."""
    try:
        proc.wait(timeout=timeout)
    finally:
        proc.kill()
    return (folder / f"group{replica}.log").read_text()


def flat(tree: object, prefix: str = "") -> dict[str, object]:
    """A nested state dict as {dotted key: leaf}."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix: tree}
