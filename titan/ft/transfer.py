"""A group's training state as plain local tensors for torchft's checkpoint transport (a healing
group fetches it from a live peer), and back into the receiver's own sharded layout.

Replica groups have the same layout, so rank r of one group holds the same shards as rank r of
another: each rank sends its DTensors' local shards and the receiver rebuilds them on its own mesh
with its own placements."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def to_local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's local shard (no copy)."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: to_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_local(v) for v in tree)
    return tree


def like(template: Any, received: Any) -> Any:
    """``received`` (local shards) laid out as ``template`` (this rank's own state dict): DTensors
    rebuilt on the template's mesh and placements, plain tensors moved to the template's device."""
    if isinstance(template, DTensor):
        local = received.to(template.device, template.dtype)
        return DTensor.from_local(
            local,
            template.device_mesh,
            template.placements,
            run_check=False,
            shape=template.shape,
            stride=template.stride(),
        )
    if isinstance(template, torch.Tensor) and isinstance(received, torch.Tensor):
        return received.to(template.device, template.dtype)
    if isinstance(template, dict) and isinstance(received, dict):
        return {k: like(template[k], v) if k in template else v for k, v in received.items()}
    if isinstance(template, (list, tuple)) and isinstance(received, (list, tuple)) and len(template) == len(received):
        return type(received)(like(t, r) for t, r in zip(template, received))
    return received
