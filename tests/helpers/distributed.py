"""Run a function on N real ranks (separate processes, each in a real process group) from an
ordinary pytest test, and the environment for CPU training subprocesses.

Every multi-rank test names its backend: ``gloo`` (the default) runs the ranks on CPU with the GPUs
hidden from them (titan's pick_device would otherwise hand rank r the GPU cuda:r, which a one-GPU
machine does not have); ``nccl`` puts rank r on cuda:r and skips the test when there are fewer GPUs
than ranks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BACKENDS = ("gloo", "nccl")


def cpu_env(**extra: str) -> dict[str, str]:
    """os.environ for a CPU training subprocess (train.py, torchrun, scripts): no GPU visible, one
    OpenMP thread per process (the machine is shared), offline Hugging Face, no torchao .so."""
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1",
    )
    env.update(extra)
    return env


# What every rank imports: the fork server imports it once per pytest session, so a rank starts as
# a fork (milliseconds) instead of a fresh interpreter importing torch and titan's trainer (~4 CPU s,
# paid by every rank of every multi-rank test). The fork server is a fresh single-threaded process
# (forking pytest itself, after earlier tests started OpenMP/gloo threads, can deadlock a child).
PRELOAD = ["torch", "torch.distributed", "titan.training.trainer", "train"]


def forkserver() -> Any:
    """The multiprocessing context whose children fork from a server that has imported PRELOAD
    (set before the server's first start; a later call changes nothing)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    init_group: bool,
    fn: Callable,
    args: tuple,
    queue: Any,
    environ: dict[str, str] | None = None,
) -> None:
    if environ is not None:
        # A forked rank has the fork server's environment: take the test's, as a spawned child would.
        os.environ.clear()
        os.environ.update(environ)
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    # The fork server imported torch before this environment: its thread pool has one thread per
    # core, which a forked rank keeps unless told (N ranks x N threads oversubscribe the cores).
    torch.set_num_threads(1)
    try:
        # Without init_group, fn sets up (and tears down) the group itself, e.g. through titan's code.
        if init_group and backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
        elif init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain bytes: torch tensors sent through a queue would go via shared-memory handles
        # that die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # reported to the parent test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 300, backend: str = "gloo", init_group: bool = True
) -> list[Any]:
    """fn(rank, world_size, *args) on each rank; returns the per-rank results in rank order.

    fn must be a module-level function (it is pickled into spawned processes). The ranks get the
    rendezvous environment (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE) and, unless
    ``init_group`` is False, a process group of ``backend``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl":
        import pytest
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            pytest.skip(f"nccl with {world_size} ranks needs {world_size} GPUs, this machine has {count}")
    # nccl ranks are spawned: a fresh interpreter initialises CUDA with the GPUs visible to it.
    ctx = forkserver() if backend == "gloo" else mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = []
    # Children take os.environ as it is when they start; CUDA reads it once, at its first use there.
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        if backend == "gloo":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        environ = dict(os.environ) if backend == "gloo" else None
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, backend, init_group, fn, args, queue, environ))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        try:
            rank, status, payload = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                errors.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
            elif time.monotonic() > deadline:
                errors.append(f"timed out after {timeout} s")
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank}:\n{payload}")
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        raise AssertionError("distributed test failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def one_rank_group(store: str) -> None:
    """A gloo group of this process alone, for a test that needs a started group inside the code it
    calls (e.g. a stand-in Trainer raising after its group exists)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
