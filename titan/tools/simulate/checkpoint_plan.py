"""The rank's part of a checkpoint save, planned by DCP and not written.

The states are the ones the trainer hands its checkpoint manager (model parts, optimizers, LR
schedulers, train state: titan/checkpointing/manager.py saves ``{name: state.state_dict()}``
through ``torch.distributed.checkpoint``). DCP's default save planner makes this rank's local plan
(the tensor shards and byte items it would write); the global step that follows on a real run
(rank 0 gathers every plan and drops the copies of replicated tensors) needs the other ranks, so
the bytes here are before that de-duplication.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from titan.checkpointing.states import ModelParts

__all__ = ["plan_save"]


def plan_save(rank: Any, is_coordinator: bool) -> dict[str, int]:
    """{"write_items", "tensor_bytes"} of this rank's local save plan."""
    state = {
        "model": ModelParts(rank.model_parts).state_dict(),
        "optimizer": rank.optimizers.state_dict(),
        "lr_scheduler": rank.lr_schedulers.state_dict(),
        "train_state": rank.train_state.state_dict(),
    }
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, storage_meta=None, is_coordinator=is_coordinator)
    plan = planner.create_local_plan()
    nbytes = 0
    for item in plan.items:
        if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
            numel = 1
            for size in item.tensor_data.chunk.sizes:
                numel *= size
            nbytes += numel * item.tensor_data.properties.dtype.itemsize
    return {"write_items": len(plan.items), "tensor_bytes": nbytes}
