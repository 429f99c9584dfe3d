"""Whole-matrix updates for sharded parameters: each matrix brought whole to one owner rank, a
function applied there, its result sent back as the same shards.

Orthogonalising optimizers (Muon) need the whole momentum matrix: Newton-Schulz on an FSDP row
shard or a TP column slice is a different optimizer. A parameter here is a plain tensor (nothing to
move) or a DTensor with any placements on any mesh (FSDP Shard(0), TP Shard(0)/Shard(1), FSDP x TP
with strided shards, the experts' EP x FSDP x TP mesh, HSDP's replicate dims). Only the mesh dims
that shard the parameter take part: every replica group (Replicate dims) does the same work.

A 2-D parameter is one matrix; a 3-D parameter [E, A, B] is E matrices (one per routed expert),
each with its own owner. Owners go round-robin over the ranks of each sharding group, so each rank
works on about 1/N of the matrices. Per parameter and step: one all_to_all bringing every shard to
the owners (bfloat16: Newton-Schulz starts by casting to it, so nothing is lost) and one sending the
results back, each moving (N-1)/N of the parameter's elements over the group in all.

Where each element lives is read once, when the plan is built (each rank's shard is a box of the
global matrix at the offset DTensor computes for any placement: the boxes are exchanged once per
parameter): the steps themselves read nothing on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["WholeMatrixPlan", "MatrixRouter", "local"]

# Encodes (group rank, local position) in one int64.
_POSITIONS = 2**32


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own elements: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class WholeMatrixPlan:
    """How one parameter's shards travel to their owners and back."""

    group: dist.ProcessGroup
    matrix_shape: tuple[int, int]
    owned_matrices: list[int]
    """The indices (experts of a 3-D parameter; [0] for a matrix) this rank orthogonalises."""
    send_perm: torch.Tensor
    """Local (flattened) positions in send order: grouped by owner rank, ascending within one."""
    send_splits: list[int]
    recv_index: torch.Tensor
    """Where each received element goes in this rank's [owned, A, B] buffer."""
    recv_splits: list[int]


class MatrixRouter:
    """Plans and runs the whole-matrix round trips of one optimizer's parameters.

    Plans are built in parameter order, the same on every rank of a group (one model, one
    construction order), which is what makes the round-robin owners agree.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._groups: dict[tuple[int, tuple[str, ...]], dist.ProcessGroup] = {}
        self._next_owner: dict[int, int] = {}
        self.plans: dict[int, WholeMatrixPlan | None] = {id(p): self._plan(p) for p in params}
        self.calls_per_step = 2 * sum(plan is not None for plan in self.plans.values())

    def _group(self, mesh: DeviceMesh, dims: tuple[int, ...]) -> dist.ProcessGroup:
        names = mesh.mesh_dim_names
        if len(dims) == 1:
            return mesh.get_group(dims[0])
        if names is None:
            raise ValueError("whole-matrix updates over several mesh dims need named mesh dims")
        key = (id(mesh), tuple(names[d] for d in dims))
        if key not in self._groups:
            sub = mesh[key[1]]
            self._groups[key] = sub._flatten("_".join(key[1]) + "_whole_matrix").get_group()
        return self._groups[key]

    def _plan(self, p: torch.Tensor) -> WholeMatrixPlan | None:
        if p.ndim not in (2, 3):
            raise ValueError(f"whole-matrix updates take 2-D or 3-D [E, A, B] parameters, got shape {tuple(p.shape)}")
        if not isinstance(p, DTensor):
            return None
        mesh, placements = p.device_mesh, p.placements
        dims = tuple(d for d, pl in enumerate(placements) if not isinstance(pl, Replicate))
        if not dims:
            return None
        group = self._group(mesh, dims)
        size, me = dist.get_world_size(group), dist.get_rank(group)
        # Every rank's element map: global element -> (its group rank, its local position). A
        # local shard is one box of the global tensor (what DCP saves it as), at the offset torch
        # computes for any placement, strided shards included; the boxes are exchanged once.
        shard = p.to_local()
        box_shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
        boxes: list = [None] * size
        dist.all_gather_object(boxes, (tuple(box_shape), tuple(offset)), group=group)
        where = torch.empty(p.shape, dtype=torch.int64, device=shard.device)
        for rank, (shape, start) in enumerate(boxes):
            if math.prod(shape):
                box = tuple(slice(o, o + n) for o, n in zip(start, shape))
                where[box] = rank * _POSITIONS + torch.arange(math.prod(shape), device=shard.device).view(shape)
        where = where.flatten()
        src_rank, src_pos = where // _POSITIONS, where % _POSITIONS

        matrices = p.shape[0] if p.ndim == 3 else 1
        per_matrix = p.numel() // matrices
        first = self._next_owner.get(id(group), 0)
        self._next_owner[id(group)] = (first + matrices) % size
        owner_of_matrix = (first + torch.arange(matrices, device=shard.device)) % size
        owner = owner_of_matrix[torch.arange(p.numel(), device=shard.device) // per_matrix]

        mine = (src_rank == me).nonzero().flatten()
        to_global = torch.empty(shard.numel(), dtype=torch.int64, device=shard.device)
        to_global[src_pos[mine]] = mine
        dest = owner[to_global]
        send_perm = torch.sort(dest, stable=True).indices
        send_splits = torch.bincount(dest, minlength=size).tolist()

        incoming = (owner == me).nonzero().flatten()
        incoming = incoming[torch.argsort(where[incoming])]  # by (sender rank, its position)
        recv_splits = torch.bincount(src_rank[incoming], minlength=size).tolist()
        owned_ids = (owner_of_matrix == me).nonzero().flatten()
        slot = torch.full((matrices,), -1, dtype=torch.int64, device=shard.device)
        slot[owned_ids] = torch.arange(owned_ids.numel(), device=shard.device)
        recv_index = slot[incoming // per_matrix] * per_matrix + incoming % per_matrix
        a, b = p.shape[-2:]
        return WholeMatrixPlan(group, (a, b), owned_ids.tolist(), send_perm, send_splits, recv_index, recv_splits)

    def apply(self, p: torch.Tensor, update: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``fn`` (a bfloat16 [A, B] matrix -> [A, B] result) on each whole matrix of ``p``, given
        this rank's shard of ``update`` (same layout as ``p``'s local shard); returns this rank's
        shard of the result."""
        plan = self.plans[id(p)]
        if plan is None:
            whole = update.reshape(-1, *update.shape[-2:])
            return torch.stack([fn(m.bfloat16()) for m in whole]).view(update.shape)
        a, b = plan.matrix_shape
        send = update.reshape(-1)[plan.send_perm].to(torch.bfloat16)
        recv = send.new_empty(sum(plan.recv_splits))
        dist.all_to_all_single(recv, send, plan.recv_splits, plan.send_splits, group=plan.group)
        owned = len(plan.owned_matrices)
        buf = recv.new_empty(owned * a * b)
        buf[plan.recv_index] = recv
        mats = buf.view(owned, a, b)
        out = torch.stack([fn(m) for m in mats]).to(torch.bfloat16) if owned else mats
        back = out.reshape(-1)[plan.recv_index]
        ret = back.new_empty(send.numel())
        dist.all_to_all_single(ret, back, plan.send_splits, plan.recv_splits, group=plan.group)
        result = torch.empty_like(ret)
        result[plan.send_perm] = ret
        return result.view(update.shape)
