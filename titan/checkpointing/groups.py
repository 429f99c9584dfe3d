"""How the ranks of one run read and write a checkpoint together.

DCP, the rank-0 decisions (and the per-step stop flag) and the in-memory snapshots each get their
own CPU (gloo) process group: an async save runs DCP's collectives in a background thread, as the
snapshots their ring copies, and on the trainer's groups (or each other's) they could interleave
with the collectives of the main thread and deadlock. A one-process run has no groups at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from titan.checkpointing.resume import agree
from titan.checkpointing.states import dcp_call


@dataclass(frozen=True)
class CheckpointGroups:
    rank: int
    world_size: int
    save_pg: Any = None
    """DCP's group (None: one process, DCP runs with no_dist)."""
    ctrl_pg: Any = None
    """The group of rank 0's decisions and of the per-step stop flag (every run of several ranks)."""
    snapshot_pg: Any = None
    """The in-memory snapshots' group (their ring copies and restores)."""

    @classmethod
    def create(cls, rank: int, world_size: int, enabled: bool, snapshots: bool = False) -> CheckpointGroups:
        if world_size == 1:
            return cls(rank, world_size)

        def gloo(wanted: bool) -> Any:
            return dist.new_group(backend="gloo") if wanted else None

        return cls(rank, world_size, gloo(enabled), gloo(True), gloo(snapshots))

    def agree(self, decide: Callable[[], Any]) -> Any:
        """Rank 0 decides; every rank gets its answer or its error."""
        return agree(decide, self.rank, self.ctrl_pg)

    def dcp(self, call: Callable[..., Any], state: dict[str, Any], path: str, **kwargs: Any) -> Any:
        """``dcp.save``/``async_save``/``load`` on the checkpoint group, or with no_dist in a
        one-process run."""
        dist_kwargs: dict[str, Any] = {"process_group": self.save_pg} if self.save_pg is not None else {"no_dist": True}
        return dcp_call(call, state, checkpoint_id=path, **dist_kwargs, **kwargs)

    def everywhere(self, action: Callable[[], None]) -> None:
        """Run ``action`` on every rank; if it raised OSError on any, every rank raises that rank's
        error (so all take the same failure path instead of some waiting in DCP's collectives)."""
        failed: tuple[int, str] | None = None
        try:
            action()
        except OSError as e:
            failed = (e.errno or 0, e.strerror or str(e))
        if self.ctrl_pg is not None:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, failed, group=self.ctrl_pg)
            failed = next((f for f in gathered if f is not None), None)
        if failed is not None:
            raise OSError(*failed)
