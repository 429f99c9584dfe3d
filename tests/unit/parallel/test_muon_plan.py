"""Planning whole-matrix updates from metadata alone (titan.parallel.muon_layout / muon_plan):
every rank's box as DTensor places it, owners balanced by Newton-Schulz FLOPs at a released width,
and the plan and a Muon step of one rank of a 4,096-rank job under fake tensors and a fake process
group: no host reads, the collectives the plan counts, no buffer the size of the model."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from tests.helpers.reads import count, undo
from titan.parallel.muon import WholeMatrixUpdates
from titan.parallel.muon_layout import build_tiling, fsdp_layout
from titan.training.muon import Muon, ns_flops, ns_workspace


def _cases() -> list:
    cases = []
    for shape in [(8, 6), (7, 5), (3, 5), (16, 12, 4), (5, 9, 3)]:
        for mesh in [(4,), (3,), (2, 2), (2, 3)]:
            singles = [Shard(0), Shard(1), Replicate()] + ([Shard(2)] if len(shape) == 3 else [])
            for pl in itertools.product(singles, repeat=len(mesh)):
                cases.append((shape, mesh, pl))
            if len(mesh) == 2:
                cases.append((shape, mesh, (_StridedShard(0, split_factor=mesh[1]), Shard(0))))
    return cases


def test_every_rank_box_is_dtensors() -> None:
    for shape, mesh, pl in _cases():
        tiling = build_tiling(shape, mesh, pl)
        dims = [d for d, p in enumerate(pl) if not isinstance(p, Replicate)]
        for coord in itertools.product(*(range(n) for n in mesh)):
            size, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), pl)
            box = tiling.box(tiling.rank_of([coord[d] for d in dims]))
            assert all(n == b[1] and (not n or o == b[0]) for n, o, b in zip(size, offset, box)), (shape, mesh, pl)


def test_interleaved_shards_are_refused() -> None:
    with pytest.raises(ValueError, match="not tiled by boxes"):
        build_tiling((8, 6), (2, 2), (Shard(0), _StridedShard(0, split_factor=2)))


def test_owners_balance_newton_schulz_at_405b_width() -> None:
    """llama3 405B's matrices, 1.7 per rank as its 126 layers over FSDP 512 (here 32 layers over
    128): no rank above 1.2x the mean FLOPs, a few buckets, the step's buffers within AdamW's
    second moment."""
    dim, hidden, kv = 16384, 53248, 1024
    shapes = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (hidden, dim), (dim, hidden), (hidden, dim)] * 32
    tilings: dict = {}
    layouts = [fsdp_layout(s, 128, 0, tilings) for s in shapes]
    params = [torch.empty(s, device="meta") for s in shapes]
    flops = [ns_flops(a, b, 5) for a, b in shapes]
    updates = WholeMatrixUpdates(params, flops, [0] * len(shapes), ns_workspace, layouts=layouts)
    (loads,) = updates.loads.values()
    assert max(loads) <= 1.2 * sum(loads) / len(loads), (max(loads), sum(loads) / len(loads))
    second_moment = sum(4 * a * b // 128 for a, b in shapes)  # AdamW's exp_avg_sq shard, fp32
    assert updates.calls_per_step <= 12 and updates.peak() <= second_moment, (updates.calls_per_step, updates.peak())


@pytest.mark.slow
def test_plan_and_step_of_one_rank_in_4096_under_fake_tensors() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titan.tools.dry_run import fake_world

    counts: Counter = Counter()
    patched: list = []
    world, rank = 4096, 4093
    colwise = (_StridedShard(0, split_factor=8), Shard(0))
    specs = [((256, 128), colwise), ((128, 256), (Shard(0), Shard(1))), ((64, 128), colwise)] * 4
    specs += [((64, 32, 16), (Shard(0), Replicate())), ((16, 32, 64), (Shard(1), Shard(2)))]
    with fake_world(rank, world):
        count(counts, patched, ("all_to_all_single",))
        mesh = init_device_mesh("cpu", (world // 8, 8), mesh_dim_names=("dp_shard", "tp"))
        mode = FakeTensorMode()
        params = []
        for shape, pl in specs:
            size, _ = _compute_local_shape_and_global_offset(shape, mesh.shape, mesh.get_coordinate(), pl)
            with mode:
                local = torch.empty(size)
            stride = torch.empty(shape, device="meta").stride()
            dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=torch.Size(shape), stride=stride)
            params.append(torch.nn.Parameter(dt))
        with mode:
            opt = Muon(params, lr=1e-3, weight_decay=0.1)
            for p in params:
                p.grad = torch.empty_like(p)
            opt.step()
        undo(patched)
    assert counts["host reads"] == 0, counts
    assert counts["all_to_all_single calls"] == opt.updates.calls_per_step > 0, counts
    travelling = {u.param for b in opt.updates.buckets for u in b.units if u.travels}
    assert len(specs) - 2 not in travelling and len(specs) - 1 in travelling  # whole experts stay, split ones travel
