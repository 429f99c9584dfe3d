"""Muon's plan at scale, from metadata alone: per-rank Newton-Schulz FLOP shares, collectives per
step and per-rank optimizer memory (Muon against AdamW) of an N-rank job, on this CPU.

    python scripts/muon_scale.py --world_size 512 --job.config_file train_configs/llama3_405b.toml
    python scripts/muon_scale.py --world_size 256 --job.config_file F --parallelism.expert_parallel_degree 64

Each pipeline stage's model is built on the meta device by titan's own build steps as the stage's
first rank of a fake process group (nothing allocated, nothing sent), then Muon's plan is made for
each model part (titan.training.muon.whole_matrix_updates). FLOPs: every rank's Newton-Schulz work,
its own whole matrices included, summed over the parts it holds. Memory: the first rank's
optimizer_state (Muon: one momentum per matrix element and AdamW's two moments for the rest;
AdamW: two moments per element) and Muon's optimizer_aux, the plan's bound on its step buffers
over all ranks (titan.training.muon.muon_memory). The last line is one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402

from titan.config import load_config  # noqa: E402
from titan.launch.check import split_world_size  # noqa: E402
from titan.parallel.muon_layout import local  # noqa: E402
from titan.tools.dry_run import fake_world  # noqa: E402
from titan.training.build import build_model  # noqa: E402
from titan.training.checks import check_job  # noqa: E402
from titan.training.loss import cross_entropy_sum  # noqa: E402
from titan.training.muon import muon_memory, split_muon_params, whole_matrix_updates  # noqa: E402

_GB = 1e9


def _global_loads(keys: dict, loads: dict, stage: range, world: int) -> list[float]:
    """NS FLOPs of every global rank of ``stage``: each sharding group's loads (the same on every
    replica of it) laid over the ranks of every copy of that group (``keys``: key -> a parameter)."""
    out = [0.0] * world
    for key, p in keys.items():
        if not isinstance(p, DTensor) or key is None:  # whole on every rank: each computes all of it
            for r in stage:
                out[r] += loads[key][0]
            continue
        mesh = p.device_mesh
        dims = [d for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate) and mesh.size(d) > 1]
        others = [d for d in range(mesh.ndim) if d not in dims]
        for copy in _copies(mesh):
            for group in copy.permute(*others, *dims).reshape(-1, len(loads[key])).tolist():
                for r, w in zip(group, loads[key]):
                    if r in stage:
                        out[r] += w
    return out


def _copies(mesh) -> list[torch.Tensor]:
    """Every copy of ``mesh`` in the world (the same mesh over other ranks), as rank grids."""
    root = mesh._get_root_mesh()
    return list(mesh._layout.remap_to_tensor(root._rank_map))


def stage(config, plan, first: int) -> dict:
    world = plan.parallel_dims.world_size
    with fake_world(first, world):
        dims = dataclasses.replace(plan.parallel_dims)
        dims.build_mesh("cpu")
        model = build_model(config, plan, dims, torch.device("cpu"), cross_entropy_sum)
        calls, buckets, matrices, travelling = 0, 0, 0, 0
        state = aux = adamw = 0
        steps = config.optimizer.ns_steps
        balance: dict = {}  # as the optimizers container shares it between a rank's parts
        keys: dict = {}
        for part in model.parts:
            mats, others = split_muon_params(part)
            memory = muon_memory(part, ns_steps=steps)
            state, aux = state + memory["optimizer_state"], max(aux, memory["optimizer_aux"])
            adamw += sum(2 * local(p).numel() * p.element_size() for p in [*mats, *others])
            if not mats:
                continue
            updates = whole_matrix_updates(mats, [0] * len(mats), [{"ns_steps": steps}], balance=balance)
            keys.update({lay.key: p for lay, p in zip(updates.layouts, mats) if lay.key not in keys})
            calls += updates.calls_per_step
            buckets += len(updates.buckets)
            matrices += sum(lay.shape[0] if len(lay.shape) == 3 else 1 for lay in updates.layouts)
            travelling += sum(u.count for b in updates.buckets for u in b.units if u.travels)
        ranks = range(first, first + world // dims.pp)
        loads = _global_loads(keys, balance, ranks, world)
    mean = sum(loads[r] for r in ranks) / len(ranks)
    return {
        "first_rank": first,
        "ranks": len(ranks),
        "matrices": matrices,
        "travelling_matrices": travelling,
        "ns_tflop_max": max(loads) / 1e12,
        "ns_tflop_mean": mean / 1e12,
        "ns_share_max_over_mean": max(loads) / mean if mean else 0.0,
        "buckets": buckets,
        "collectives_per_step": calls,
        "muon_state_gb": state / _GB,
        "muon_aux_gb": aux / _GB,
        "muon_total_gb": (state + aux) / _GB,
        "adamw_state_gb": adamw / _GB,
    }


def main(argv: list[str]) -> int:
    one = None
    if argv[:1] == ["--stage"]:  # one pipeline stage, in a process of its own (below)
        one, argv = int(argv[1]), argv[2:]
    args, world = split_world_size(argv)
    assert world is not None, "--world_size N"
    config = load_config([*args, "--optimizer.name", "Muon"])
    plan = check_job(config, world, "cuda", data_here=False)
    assert plan is not None
    pp = plan.parallel_dims.pp
    if one is not None:
        print(json.dumps(stage(config, plan, one * (world // pp))))
        return 0
    start = time.time()
    # A fresh process per stage: torch keeps some mesh groups of a destroyed fake world by name.
    stages = []
    for s in range(pp):
        run = subprocess.run([sys.executable, __file__, "--stage", str(s), *argv], capture_output=True, text=True)
        if run.returncode:
            sys.stderr.write(run.stderr)
            return run.returncode
        stages.append(json.loads(run.stdout.strip().splitlines()[-1]))
    for s in stages:
        print(
            f"stage of rank {s['first_rank']}: {s['matrices']} matrices ({s['travelling_matrices']} travel),"
            f" NS TFLOP per rank max {s['ns_tflop_max']:.1f} / mean {s['ns_tflop_mean']:.1f}"
            f" = {s['ns_share_max_over_mean']:.3f}, {s['buckets']} buckets, {s['collectives_per_step']} all_to_alls"
            f" per step; per rank GB: Muon state {s['muon_state_gb']:.2f} + aux {s['muon_aux_gb']:.2f}"
            f" = {s['muon_total_gb']:.2f} vs AdamW state {s['adamw_state_gb']:.2f}"
        )
    summary = {
        "world_size": world,
        "model": f"{config.model.name} {config.model.flavor}",
        "layers": config.model.n_layers,
        "stages": stages,
        "seconds": round(time.time() - start, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
