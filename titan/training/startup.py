"""What rank 0 reports and keeps before the first step: the summary table and the merged config.

The table answers the questions a run's first screen should: which devices and how many, how
the ranks are laid out, how large the model is (parameters, their memory, FLOPs per token), the
peak FLOP/s that MFU divides by and where that number comes from, whether the memory estimate
fits the device (not estimated again after a restart: seconds of fake steps a restart would wait
for), and how often in-memory snapshots are taken and the host memory they take.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from tabulate import tabulate
from torch.distributed.tensor import DTensor

from titan.config.job_config import JobConfig
from titan.log import logger
from titan.parallel.dims import ParallelDims

__all__ = ["summary_rows", "log_summary"]


def _size(nbytes: float) -> str:
    return f"{nbytes / 1024**3:.2f} GiB" if nbytes >= 1024**3 else f"{nbytes / 1024**2:.1f} MiB"


def _device(device: torch.device) -> tuple[str, float | None, str]:
    """(device name, memory capacity in bytes or None, what the capacity is)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return torch.cuda.get_device_name(device), float(props.total_memory), "device memory"
    try:
        ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError):
        ram = None
    return f"{device.type} ({os.cpu_count()} cores)", ram, "host RAM (all ranks on this machine)"


def _param_bytes(model_parts: list[nn.Module], num_params: int) -> tuple[int, float]:
    """(bytes of the parameters this rank holds, as allocated; bytes of all ``num_params``
    parameters at the same bytes per element: with PP this rank holds only its stages)."""
    local = numel = nbytes = 0
    for p in {id(p): p for part in model_parts for p in part.parameters()}.values():
        shard = p.to_local() if isinstance(p, DTensor) else p
        local += shard.numel() * shard.element_size()
        numel += p.numel()
        nbytes += p.numel() * p.element_size()
    return local, num_params * nbytes / max(numel, 1)


def _peak_text(peak_flops: float | None, device_name: str, device: torch.device, float8: bool) -> str:
    if peak_flops:
        precision = "float8" if float8 else "bf16"
        return (
            f"{peak_flops / 1e12:,.1f} TFLOP/s dense {precision} (titan/training/flops.py peak table,"
            f" by device name {device_name!r})"
        )
    if device.type != "cuda":
        return "n/a (no peak for CPUs in titan/training/flops.py; MFU shows n/a)"
    return f"n/a ({device_name!r} is not in the titan/training/flops.py peak table; MFU shows n/a)"


def _memory_text(config: JobConfig, world_size: int, capacity: float | None, what: str) -> str:
    from titan.parallel.fake_world import in_multi_rank_launch
    from titan.training.memory import estimate_memory

    if not config.metrics.startup_memory_estimate:
        return "off (metrics.startup_memory_estimate = false; --job.dry_run estimates it)"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart not in ("", "0"):  # seconds of fake forward/backward that a restart would wait for
        return f"as in the first attempt's table (not estimated again on restart {restart})"
    if in_multi_rank_launch():  # the estimate plays a rank in a fake world of its own
        return (
            "n/a in a rank of a multi-rank run (--job.dry_run or scripts/estimate_memory.py estimate it in one process)"
        )

    try:
        estimate = estimate_memory(config, world_size).total_bytes
    except Exception as e:  # the estimate informs; training does not depend on it
        first = str(e).splitlines()[0] if str(e) else ""
        return f"n/a (titan/training/memory.py: {type(e).__name__}: {first[:200]})"
    if not capacity:
        return f"{_size(estimate)} per rank (titan/training/memory.py); capacity unknown"
    share = f"{100 * estimate / capacity:.0f}%"
    return f"{_size(estimate)} per rank of {_size(capacity)} {what}: {share} (titan/training/memory.py)"


def _loss_text(config: JobConfig, model_parts: list[nn.Module]) -> str:
    """How the loss meets the vocabulary: the rows the model has and whether the logits exist whole."""
    t = config.training
    from titan.training.loss import output_module

    output = output_module(model_parts)  # its weight's global shape, also under FSDP / TP
    weight = getattr(output, "weight", None)
    vocab = f"{weight.shape[0]:,} vocabulary rows" if weight is not None else "output on another pipeline stage"
    tokens = t.local_batch_size * t.seq_len
    depth = config.model.mtp_depth
    mtp = f"; + multi-token prediction, {depth} depth(s) at weight {t.mtp_loss_weight}" if depth else ""
    if t.loss_chunk_tokens > 0:
        return f"output + cross entropy by chunks of {t.loss_chunk_tokens:,} tokens ({vocab}){mtp}"
    return f"full logits, {tokens:,} tokens per micro-batch ({vocab}){mtp}"


def summary_rows(
    config: JobConfig,
    *,
    device: torch.device,
    parallel_dims: ParallelDims,
    model_parts: list[nn.Module],
    num_params: int,
    flops_per_token: int,
    peak_flops: float | None,
    float8: bool,
    snapshots: str = "",
) -> list[tuple[str, str]]:
    """The rows of the start-up table, as (what, value) text."""
    pd = parallel_dims
    name, capacity, capacity_what = _device(device)
    local_bytes, full_bytes = _param_bytes(model_parts, num_params)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for part in model_parts for p in part.parameters()})
    return [
        ("device", f"{pd.world_size} x {name}"),
        (
            "world size, layout",
            f"{pd.world_size}: dp_replicate {pd.dp_replicate}, dp_shard {pd.dp_shard},"
            f" tp {pd.tp}, pp {pd.pp}, cp {pd.cp}",
        ),
        ("model", f"{config.model.name} {config.model.flavor}: {num_params:,} parameters"),
        ("loss", _loss_text(config, model_parts)),
        ("parameter memory", f"{_size(full_bytes)} in all ({', '.join(dtypes)}), {_size(local_bytes)} on rank 0"),
        ("FLOPs per token", f"{flops_per_token:,} (forward + backward at seq_len {config.training.seq_len})"),
        ("peak FLOP/s for MFU", _peak_text(peak_flops, name, device, float8)),
        ("memory estimate", _memory_text(config, pd.world_size, capacity, capacity_what)),
        *([("in-memory snapshots", snapshots)] if snapshots else []),
    ]


def log_summary(rows: list[tuple[str, str]]) -> str:
    """Log the table (one message) and return its text."""
    table = tabulate(rows, tablefmt="plain")
    logger.info("start-up summary:\n" + table)
    return table
