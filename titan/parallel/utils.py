"""Process-group set-up, device choice, seeding, gradient clipping across shards, and the blocks of a model."""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan.errors import TitanError
from titan.log import logger


def world_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; a plain run is 1 process."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def pick_device(local_rank: int) -> torch.device:
    """cuda:<local rank> when torch sees a GPU, else the CPU (CUDA_VISIBLE_DEVICES= forces the CPU)."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise TitanError(
                f"local rank {local_rank} needs GPU cuda:{local_rank} but {count} GPU(s) are visible: launch at most"
                f" {count} process(es) per node (torchrun --nproc_per_node / NGPU), or hide the GPUs"
                " (CUDA_VISIBLE_DEVICES=) to run every rank on the CPU with gloo"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device, world_size: int, timeout_s: int = 300) -> None:
    """nccl on CUDA (with gloo for CPU tensors), gloo on CPU. Only under a launcher (world > 1)."""
    if world_size == 1 or dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    logger.info(f"initialized {backend} process group, world size {world_size}")


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def set_seed(seed: int) -> None:
    """Same seed on every rank: data order comes from the loader, not from the RNG. Deterministic
    kernels are titan.training.determinism's job (training.deterministic)."""
    random.seed(seed)
    torch.manual_seed(seed)


def _total_l2_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.nn.utils.get_total_norm(tensors, 2.0, foreach=True), the same numbers, without its
    per-tensor ``.to(first device)`` when all tensors share one device: one op per parameter every
    step (a DTensor dispatch each under FSDP/TP) that moves nothing."""
    if not tensors or len({t.device for t in tensors}) != 1:
        return torch.nn.utils.get_total_norm(tensors, norm_type=2.0, foreach=True)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:  # foreach kernels take one dtype per list
        by_dtype.setdefault(t.dtype, []).append(t)
    foreach_norm = torch._foreach_norm  # pyright: ignore[reportPrivateImportUsage]
    norms = [n for group in by_dtype.values() for n in foreach_norm(group, 2.0)]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by DTensor mesh (plain tensors together): foreach ops take one mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def global_l2_norm(tensors: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """L2 norm over tensors that may be DTensor shards, and (with PP) over every pipeline stage.
    DTensors on different meshes (expert parallel's experts beside the dense parameters) are
    normed mesh by mesh, then combined."""
    norms = []
    for group in by_mesh(tensors) or [[]]:  # no tensors: a zero norm, as torch's get_total_norm gives
        part = _total_l2_norm(group)
        norms.append((part.full_tensor() if isinstance(part, DTensor) else part).float())
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    if pp_group is not None:
        sq = norm.pow(2)
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pp_group)
        norm = sq.sqrt()
    return norm


def total_grad_norm(parameters: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """L2 norm of all gradients, summed over DTensor shards and (with PP) over pipeline stages."""
    return global_l2_norm([p.grad for p in parameters if p.grad is not None], pp_group)


def clip_grad_norm_(
    parameters: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip to max_norm (if > 0) and return the total norm before clipping."""
    norm = total_grad_norm(parameters, pp_group)
    if max_norm > 0:
        for group in by_mesh(parameters):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def blocks_of(model: nn.Module) -> nn.ModuleDict:
    """``model.layers``: the blocks, keyed by layer id, that AC, compile and FSDP wrap one by one."""
    layers = model.get_submodule("layers")
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(f"{type(model).__name__}.layers is a {type(layers).__name__}; blocks must be an nn.ModuleDict")
    return layers
