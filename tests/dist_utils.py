"""Run a function on N real gloo ranks (spawned processes) from an ordinary pytest test."""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import multiprocessing as mp
import pickle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain bytes: torch tensors sent through a queue would go via shared-memory handles
        # that die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """fn(rank, world_size, *args) on each rank; returns the per-rank results in rank order.

    fn must be a module-level function (it is pickled into spawned processes).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
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
