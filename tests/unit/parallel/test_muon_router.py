"""Whole-matrix updates (titan.parallel.muon) on real gloo ranks: for every placement a titan
layout gives a matrix or an expert stack (FSDP / TP rows or columns, strided FSDP x TP, 2-D
meshes, replicate dims, uneven and empty shards), the function applied on the owners to the whole
matrices comes back as exactly the shards of the function of the unsharded matrices; each matrix
has one owner per replica group, whole experts stay where they are, and the work is spread. Run
once with one bucket per sharding group and once with buckets so small that every bucket's
shards travel while the previous one is computed; and Muon's step on such ranks allocates no more
than the plan's bound, itself within the budget of AdamW's second moment."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tests.helpers.distributed import run_distributed
from titan.parallel.muon import WholeMatrixUpdates
from titan.parallel.muon_layout import local


def _fn(x: torch.Tensor) -> torch.Tensor:
    """Equivariant under row and column permutations (as Newton-Schulz is), yet a misplaced
    element changes its row and column sums; exact in bf16 for the small integers used here."""
    f = x.float()
    return f * 3 + f.sum(-1, keepdim=True) + 2 * f.sum(-2, keepdim=True)


def _specs(world: int) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple]]:
    """(mesh shape, parameter shape, placements) of every case."""
    specs = []
    for shape in [(8, 6), (7, 5), (4, 6, 10), (3, 5, 4), (6, 3, 4)]:
        placements = [(Shard(0),), (Shard(1),), (Replicate(),)] + ([(Shard(2),)] if len(shape) == 3 else [])
        specs += [((world,), shape, pl) for pl in placements]
    if world == 4:
        for shape in [(8, 6), (4, 6, 10), (6, 5)]:
            for pl in [(Shard(0), Shard(0)), (Shard(0), Shard(1)), (Replicate(), Shard(0)), (Shard(1), Shard(0))]:
                specs.append(((2, 2), shape, pl))
        # FSDP over TP's rows: strided shards, row blocks out of order
        specs.append(((2, 2), (8, 6), (_StridedShard(0, split_factor=2), Shard(0))))
    return specs


def _run(params: list, cases: list, fulls: list, share: int | None) -> dict:
    """One step of ``_fn`` over every case: what came back wrong, who owned what, the plan's counts."""
    flops = [a * b for *_, a, b in (p.shape for p in params)]
    updates = WholeMatrixUpdates(params, flops, [0] * len(params), lambda k, a, b: 0, share=share)
    results = [torch.full_like(local(p), float("nan")) for p in params]

    def fn(x: torch.Tensor, i: int) -> None:
        assert x.dtype == torch.bfloat16 and x.shape[-2] <= x.shape[-1]
        x.copy_(_fn(x))

    def update(i: int, index: tuple, out: torch.Tensor) -> bool:
        out.copy_(local(params[i])[index])
        return True

    def apply(i: int, index: tuple, o: torch.Tensor) -> None:
        results[i][index] = o.float()

    updates.run(update, fn, apply, torch.device("cpu"))
    wrong = []
    for i, ((mesh, shape, pl), full) in enumerate(zip(cases, fulls)):
        mats = full.reshape(-1, *shape[-2:]).bfloat16()
        whole = torch.stack([_fn(m if m.shape[0] <= m.shape[1] else m.T) for m in mats])
        whole = whole.view(-1, *shape[-2:][::-1]).mT if shape[-2] > shape[-1] else whole
        want = distribute_tensor(whole.reshape(shape).bfloat16().float(), mesh, pl, src_data_rank=None)
        if not torch.equal(results[i], want.to_local()):
            wrong.append((shape, str(pl)))
    owned: dict[int, list[int]] = {i: [] for i in range(len(params))}
    travelling = [0] * len(params)
    for b in updates.buckets:
        for u in b.units:
            travelling[u.param] += u.travels
            if u.owner == updates.layouts[u.param].me:
                owned[u.param] += list(range(u.first, u.first + u.count))
    replica = [tuple(c for c, q in zip(mesh.get_coordinate(), pl) if isinstance(q, Replicate)) for mesh, _, pl in cases]
    return {
        "wrong": wrong,
        "owned": [(replica[i], owned[i], updates.layouts[i].tiling is None) for i in range(len(params))],
        "travelling": travelling,
        "calls": updates.calls_per_step,
        "ahead": sum(b.ahead for b in updates.buckets),
    }


def _round_trips(rank: int, world: int, _: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    meshes = {
        (world,): init_device_mesh("cpu", (world,), mesh_dim_names=("a",)),
        **({(2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))} if world == 4 else {}),
    }
    cases = [(meshes[m], shape, pl) for m, shape, pl in _specs(world)]
    params, fulls = [], []
    for mesh, shape, pl in cases:
        full = torch.randint(-3, 4, shape, generator=gen).float()
        params.append(distribute_tensor(full, mesh, pl, src_data_rank=None))
        fulls.append(full)
    out = {name: _run(params, cases, fulls, share) for name, share in (("one bucket", None), ("small buckets", 64))}
    out["memory"] = _step_memory(meshes[(world,)])
    dist.barrier()
    return out


def _step_memory(mesh) -> dict:
    """Muon's step buffers on this rank (every storage a second step allocates beyond parameters,
    gradients and momentum) against the plan's bound, with buckets that overlap."""
    from titan.training.memory import LiveBytes
    from titan.training.muon import Muon

    torch.manual_seed(1)
    shapes = [((96, 64), Shard(0)), ((64, 160), Shard(1)), ((8, 48, 32), Shard(0)), ((4, 40, 24), Shard(1))] * 6
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s), mesh, (pl,))) for s, pl in shapes]
    opt = Muon(params, lr=1e-2, weight_decay=0.1, share=24_000)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    tracker = LiveBytes()
    held = [*params, *(p.grad for p in params), *(s["momentum_buffer"] for s in opt.state.values())]
    tracker.ignore([local(t) for t in held])
    with tracker:
        opt.step()
    u = opt.updates
    return {"measured": tracker.peak, "bound": u.peak(), "budget": u.budget, "ahead": sum(b.ahead for b in u.buckets)}


@pytest.mark.slow
def test_whole_matrix_round_trip_on_every_placement() -> None:
    world = 4  # 1-D meshes of 4 (even, uneven and empty shards) and 2 x 2 meshes in one process group
    results = run_distributed(_round_trips, world, "")
    specs = _specs(world)
    for name in ("one bucket", "small buckets"):
        per_rank = [r[name] for r in results]
        assert all(not r["wrong"] for r in per_rank), (name, [r["wrong"] for r in per_rank])
        for i, (_, shape, pl) in enumerate(specs):
            plans = [r["owned"][i] for r in per_rank]
            matrices = shape[0] if len(shape) == 3 else 1
            if plans[0][2]:  # replicated on every dim: each rank computes its own copy
                assert all(ms == list(range(matrices)) for _, ms, _ in plans)
                continue
            for replica in {p[0] for p in plans}:
                owners = sorted(m for rank_replica, ms, _ in plans if rank_replica == replica for m in ms)
                assert owners == list(range(matrices)), (name, shape, pl, owners)  # each once per group
            if len(shape) == 3 and pl == (Shard(0),):  # whole experts stay with their holders
                assert per_rank[0]["travelling"][i] == 0, (shape, pl)
    small, one = results[0]["small buckets"], results[0]["one bucket"]
    assert small["ahead"] > 0 and small["calls"] > one["calls"], (small, one)
    for memory in (r["memory"] for r in results):  # the plan's bound holds, within the budget
        assert 0 < memory["measured"] <= memory["bound"] <= memory["budget"] and memory["ahead"], memory
