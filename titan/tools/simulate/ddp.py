"""DDP under the fake process group.

torch's DDP reducer waits on each bucket's all-reduce and takes the tensor its future returns;
the fake backend's all-reduce completes with no tensor. A communication hook does the same
all-reduce (so it is counted, with its bytes) and hands the bucket back averaged, as DDP's default
hook does: the reducer then sees what it expects.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import GradBucket  # pyright: ignore[reportPrivateImportUsage]
from torch.distributed._composable.replicate import DDP

__all__ = ["hook_ddp"]


def hook_ddp(rank: Any) -> None:
    """Give every DDP-wrapped part of the rank the all-reduce hook (before its first forward)."""
    mesh = rank.parallel_dims.submesh("dp_replicate")
    if mesh is None:
        return
    group = mesh.get_group()

    def all_reduce(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        dist.all_reduce(buffer, group=group)
        buffer.div_(group.size())
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    # DDP checks the hook's annotations as objects (this module's are strings)
    all_reduce.__annotations__ = {
        "state": object,
        "bucket": GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    for part in rank.model_parts:
        if isinstance(part, DDP):
            part.register_comm_hook(None, all_reduce)
