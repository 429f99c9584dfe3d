"""Whole-matrix round trips (titan.parallel.muon) on real gloo ranks: for every placement a titan
layout gives a matrix or an expert stack (FSDP / TP rows or columns, 2-D meshes, replicate dims,
uneven shards), the function applied on the owner to the whole matrix comes back as exactly the
shards of the function of the unsharded matrix; each matrix has one owner per replica group, and
owners are spread over the ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests.helpers.distributed import run_distributed
from titan.parallel.muon import MatrixRouter


def _fn(m: torch.Tensor) -> torch.Tensor:
    """Position-dependent, so a misplaced element changes the result."""
    return (m.float() * 2 + torch.arange(m.numel()).view(m.shape) % 7).bfloat16()


def _specs(world: int) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple]]:
    """(mesh shape, parameter shape, placements) of every case."""
    specs = []
    for shape in [(8, 6), (7, 5), (4, 6, 10), (3, 5, 4)]:
        placements = [(Shard(0),), (Shard(1),), (Replicate(),)] + ([(Shard(2),)] if len(shape) == 3 else [])
        specs += [((world,), shape, pl) for pl in placements]
    if world == 4:
        for shape in [(8, 6), (4, 6, 10), (6, 5)]:
            for pl in [(Shard(0), Shard(0)), (Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Shard(0))]:
                specs.append(((2, 2), shape, pl))
    return specs


def _round_trips(rank: int, world: int, _: str) -> dict:
    torch.manual_seed(0)
    meshes = {
        (world,): init_device_mesh("cpu", (world,), mesh_dim_names=("a",)),
        **({(2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))} if world == 4 else {}),
    }
    cases = [(meshes[m], shape, pl) for m, shape, pl in _specs(world)]
    params = []
    for mesh, shape, pl in cases:
        full = torch.randn(shape)
        dist.broadcast(full, 0)
        params.append((distribute_tensor(full, mesh, pl), full))
    router = MatrixRouter([p for p, _ in params])
    wrong, owned = [], []
    for (p, full), (mesh, shape, pl) in zip(params, cases):
        out = router.apply(p, p.to_local(), _fn)
        whole = torch.stack([_fn(m.bfloat16()) for m in full.reshape(-1, *shape[-2:])]).view(shape)
        if not torch.equal(out, distribute_tensor(whole, mesh, pl, src_data_rank=None).to_local()):
            wrong.append((shape, str(pl)))
        plan = router.plans[id(p)]
        replica = tuple(c for c, q in zip(mesh.get_coordinate(), pl) if isinstance(q, Replicate))
        owned.append((replica, plan.owned_matrices if plan is not None else None))
    return {"wrong": wrong, "owned": owned}


@pytest.mark.slow
def test_whole_matrix_round_trip_on_every_placement() -> None:
    world = 4  # 1-D meshes of 4 (even and uneven shards) and 2 x 2 meshes in one process group
    results = run_distributed(_round_trips, world, "")
    assert all(not r["wrong"] for r in results), [r["wrong"] for r in results]
    per_rank_work = [0] * world
    for i, (_, shape, _) in enumerate(_specs(world)):
        plans = [r["owned"][i] for r in results]
        if plans[0][1] is None:  # replicated on every dim: each rank computes its own copy
            continue
        for replica in {p[0] for p in plans}:
            owners = [m for rank_replica, ms in plans if rank_replica == replica for m in ms]
            matrices = shape[0] if len(shape) == 3 else 1
            assert sorted(owners) == list(range(matrices)), (shape, owners)  # each exactly once per group
        for rank, (_, ms) in enumerate(plans):
            per_rank_work[rank] += len(ms)
    assert max(per_rank_work) - min(per_rank_work) <= 2, per_rank_work  # spread round-robin
