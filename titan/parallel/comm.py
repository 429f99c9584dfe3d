"""Collective timeouts and the NCCL flight recorder ([comm] config section).

Two timeouts: start-up (process-group init, first step with compile / checkpoint loading) may
legitimately take long, while a steady-state hang should fail fast. So the process groups start
with ``init_timeout_seconds`` and switch to ``train_timeout_seconds`` once the first step is done.

The flight recorder (NCCL only) keeps the last ``trace_buf_size`` collectives per rank and dumps
them on a timeout, which tells which rank stopped calling which collective. Its settings are
environment variables that NCCL process groups read when they are created, so
``set_comm_env`` must run before ``init_process_group``. On gloo they are set but unused, and
the dump folder is not made.
"""

from __future__ import annotations

import datetime
import os
from types import MappingProxyType

import torch
import torch.distributed as dist

from titan.config.job_config import Comm
from titan.log import logger
from titan.parallel.dims import ParallelDims

__all__ = ["set_comm_env", "set_pg_timeouts"]


# What launchers (not users) put in the environment: torchrun's agent gives every worker
# TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless it is already set.
_LAUNCHER_DEFAULTS = MappingProxyType({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})


def _set_env(name: str, value: str, *, nccl: bool) -> None:
    """Set ``name``; warn only when that replaces a value someone chose and NCCL will read it."""
    old = os.environ.get(name)
    if nccl and old is not None and old != value and _LAUNCHER_DEFAULTS.get(name) != old:
        logger.warning(f"[comm] {name}={old} from the environment is replaced by {value} ([comm] config)")
    os.environ[name] = value


def set_comm_env(m: Comm, dump_folder: str, *, nccl: bool | None = None) -> dict[str, str]:
    """Set the variables for the flight recorder (TORCH_FR_*, TORCH_NCCL_*); returns what was set.

    ``nccl``: whether this run's process group uses NCCL (None: whether CUDA is available). The
    variables are set either way (unused by gloo), but replacing a value someone chose is only
    worth a warning when NCCL reads it. ``m`` has passed Comm.validate (load_config); the traces
    go under ``dump_folder`` (job.dump_folder)."""
    if nccl is None:
        nccl = torch.cuda.is_available()
    env = {
        # The flight recorder's size under the name torch reads now: its old name
        # TORCH_NCCL_TRACE_BUFFER_SIZE still works but makes every process group print a
        # deprecation warning (torch/csrc/distributed/c10d/FlightRecorder.hpp reads
        # {TORCH_FR_BUFFER_SIZE, TORCH_NCCL_TRACE_BUFFER_SIZE}, the first name winning).
        "TORCH_FR_BUFFER_SIZE": str(m.trace_buf_size),
        # The recorder only dumps when the watchdog does not tear the process down first:
        # mode 3 = skip cleanup (pytorch/pytorch#121055), used whether or not the recorder is on
        # so that behaviour does not change with the buffer size.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }
    if m.trace_buf_size > 0:
        folder = os.path.join(dump_folder, m.save_traces_folder)
        # Made only where a dump can come: NCCL groups with collectives to trace. The dump opens its
        # file there without creating the folder, and a hang may come as early as the first group.
        if nccl and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            os.makedirs(folder, exist_ok=True)
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = os.path.join(folder, "rank_")
    for name, value in env.items():
        _set_env(name, value, nccl=nccl)
    return env


def _groups(parallel_dims: ParallelDims) -> list[dist.ProcessGroup]:
    world = dist.group.WORLD
    assert world is not None, "set_pg_timeouts runs only with a process group"
    groups = [world]
    mesh = parallel_dims.mesh
    if mesh is not None:
        groups += mesh.get_all_groups()
        for flat in ("dp", "dp_shard_cp", "dp_cp"):
            sub = parallel_dims.submesh(flat)
            if sub is not None and sub.ndim == 1:
                groups.append(sub.get_group())
    unique: dict[int, dist.ProcessGroup] = {}
    for g in groups:
        unique.setdefault(id(g), g)
    return list(unique.values())


def set_pg_timeouts(seconds: int, parallel_dims: ParallelDims, device: torch.device) -> int:
    """Switch every process group this rank uses to ``seconds``; returns how many were changed.

    Synchronises first so no collective issued under the old timeout is still in flight.
    """
    if parallel_dims.world_size == 1 or not dist.is_initialized():
        return 0
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    groups = _groups(parallel_dims)
    timeout = datetime.timedelta(seconds=seconds)
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    logger.info(f"collective timeout set to {seconds}s on {len(groups)} process group(s)")
    return len(groups)
