"""Dry run: check a layout for N ranks on one CPU process, before paying for the GPUs.

The run is checked and planned as the launcher and the Trainer check it (titan/training/checks.py
check_job and titan/training/plan.py: config checks, layout, model args, gradient accumulation, the
model plan, every check that needs the world size or the device, here for CUDA devices); a fake
process group (no communication) stands in for the world, the Trainer's build steps
(titan/training/build.py: mesh, meta model, float8, pipeline split or parallelize) run unchanged,
and the dry run stops before any memory is allocated. Then every parameter's sharding spec gives
each rank's local shard, from which the per-rank parameter count and memory follow. Pipeline
stages are built one at a time, as the first rank of each stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from titan.config.dialects import log_translations
from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.log import init_logger
from titan.parallel.dims import ParallelDims
from titan.parallel.fake_world import fake_world
from titan.training.build import BuiltModel, build_model
from titan.training.checks import check_job
from titan.training.loss import cross_entropy_sum
from titan.training.plan import RunPlan

GIB = 1024**3
# Optimizer state elements per parameter element (exp_avg and exp_avg_sq for Adam / AdamW).
_OPTIM_STATES = MappingProxyType({"adamw": 2, "adam": 2})


def estimate_rank_memory(local_params: int, config: JobConfig) -> dict[str, float]:
    """Model-state GiB on one rank from its own sharded parameter count: FSDP keeps the sharded
    parameters, gradients and optimizer states in float32."""
    states = _OPTIM_STATES.get(config.optimizer.name.lower(), 2)
    out = {"params": local_params * 4 / GIB, "grads": local_params * 4 / GIB}
    out["optim"] = local_params * 4 * states / GIB
    return out


def estimate_shared_memory(config: JobConfig, degrees: dict[str, int], world: int) -> tuple[dict[str, float], str]:
    """Rank 0's GiB by category at its peak from titan/training/memory's estimator, and a note saying
    what the columns hold. Empty for TP/PP/CP layouts (their estimate profiles the model at full
    sequence, more than a dry run should take: scripts/estimate_memory.py gives it) and where the
    estimator does not model a setting."""
    states = "params, optim: fp32 sharded parameters and AdamW states of each rank"
    if degrees["tp"] > 1 or degrees["pp"] > 1 or degrees["cp"] > 1:
        return {}, states + "; grads: fp32 sharded; activations: scripts/estimate_memory.py for TP/PP/CP layouts"
    from titan.training.memory import estimate_memory

    try:
        est = estimate_memory(config, world)
    except TitanError as e:  # a setting the estimator does not model: the plan itself is still valid
        return {}, states + f"; grads: fp32 sharded; activations not estimated ({e})"
    c = est.categories
    extra = {
        "params": c["parameters"] / GIB,
        "grads": c["gradients"] / GIB,
        "optim": (c["optimizer_state"] + c["optimizer_aux"]) / GIB,
        "comm": c["communication"] / GIB,
        "act": (c["activations"] + c["loss"]) / GIB,
    }
    t = config.training
    return extra, (
        f"the estimator's categories at the rank's peak ({est.peak_moment}): params, optimizer state and"
        f" temporaries; grads held; comm: FSDP's gathered parameters and reduce-scatter inputs; act:"
        f" activations and the loss at local batch {t.local_batch_size} x {t.seq_len} (activation"
        f" checkpointing {config.activation_checkpoint.mode}); not counted: allocator caching, NCCL buffers"
    )


@dataclass
class DryRunReport:
    plan: RunPlan  # as the Trainer plans the same config (checked for CUDA devices)
    world_size: int
    mesh: str
    degrees: dict[str, int]
    stages: list[str]  # one line per pipeline rank: which layers and modules its stage(s) hold
    model_params: int  # the trainer's count of the whole (unsplit) model
    per_rank_params: list[int]  # index = global rank
    distinct_shard_params: int  # sum over ranks, each replicated shard counted once
    memory: list[dict[str, float]] = field(default_factory=list)  # per rank, GiB
    memory_note: str = ""
    transforms: str = ""

    @property
    def ok(self) -> bool:
        return self.distinct_shard_params == self.model_params


def _describe_stage(parts: list[nn.Module]) -> str:
    pieces = []
    for part in parts:
        layers = list(getattr(part, "layers", {}).keys())
        ends = [n for n in ("tok_embeddings", "norm", "output", "mtp") if getattr(part, n, None) is not None]
        span = f"layers {layers[0]}-{layers[-1]} ({len(layers)})" if len(layers) > 1 else "no layers"
        if len(layers) == 1:
            span = f"layer {layers[0]} (1)"
        pieces.append(span + (" + " + ", ".join(ends) if ends else ""))
    return "; ".join(pieces)


def _groups(mesh) -> torch.Tensor:
    """All copies of `mesh` across the world: shape (copies, *mesh.shape) of global ranks."""
    root = mesh._get_root_mesh()
    try:
        return mesh._layout.remap_to_tensor(root._rank_map)
    except AttributeError:  # pragma: no cover - older torch without DeviceMesh layouts
        raise TitanError("job.dry_run needs torch >= 2.10 (DeviceMesh layouts); this torch is older") from None


def _shard_sizes(p: DTensor) -> tuple[list[tuple[int, ...]], list[int]]:
    """Local element count of `p` at every coordinate of its mesh, checked against this rank."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh, placements = p.device_mesh, list(p.placements)
    grid = torch.cartesian_prod(*[torch.arange(n) for n in mesh.shape]).reshape(-1, mesh.ndim)
    coords = [tuple(c) for c in grid.tolist()]
    sizes = [
        torch.Size(
            _compute_local_shape_and_global_offset(p.shape, mesh.shape, list(c), placements, skip_offset=True)[0]
        ).numel()
        for c in coords
    ]
    # This process is a real rank of the mesh: the computed shard must be the one actually built.
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # every rank of the fake world is in every mesh it builds
        raise TitanError(f"dry run: rank {dist.get_rank()} is not in the mesh {mesh}")
    mine = sizes[coords.index(tuple(coordinate))]
    if mine != p.to_local().numel():
        raise TitanError(f"dry run: local shard has {p.to_local().numel()} elements, the spec says {mine}")
    return coords, sizes


def _count_stage(parts: list[nn.Module], stage_ranks: list[int], world_size: int) -> tuple[list[int], int]:
    """Local parameter elements of every rank in the stage, and the stage's distinct elements
    (each shard counted once; copies of a shard on data-parallel replicas are not distinct)."""
    per_rank = [0] * world_size
    in_stage = set(stage_ranks)
    distinct = 0
    cache: dict[tuple, tuple[list[tuple[int, ...]], list[int], int]] = {}
    for part in parts:
        for p in part.parameters():
            if not isinstance(p, DTensor):
                for r in stage_ranks:
                    per_rank[r] += p.numel()
                distinct += p.numel()
                continue
            placements = tuple(p.placements)
            key = (tuple(p.shape), placements, p.device_mesh)
            if key not in cache:
                coords, sizes = _shard_sizes(p)
                # Mesh dims where p is replicated hold copies: count coordinate 0 there.
                one_copy = sum(
                    s
                    for c, s in zip(coords, sizes)
                    if all(c[i] == 0 for i, pl in enumerate(placements) if isinstance(pl, Replicate))
                )
                cache[key] = (_groups(p.device_mesh).flatten(1).tolist(), sizes, one_copy)
            groups, sizes, one_copy = cache[key]
            # The mesh's copies in other pipeline stages hold other modules: skip their ranks.
            for group in groups:
                for r, s in zip(group, sizes):
                    if r in in_stage:
                        per_rank[r] += s
            distinct += one_copy
    return per_rank, distinct


@dataclass
class _Stage:
    """One pipeline stage as built by its first rank."""

    dims: ParallelDims
    model: BuiltModel
    counts: list[int]  # local parameter elements per global rank (0 outside the stage)
    distinct: int
    mesh_text: str


def _build_stage(config: JobConfig, plan: RunPlan, first_rank: int) -> _Stage:
    """Build the pipeline stage whose first rank is `first_rank`, as that rank, with the Trainer's
    build steps (titan/training/build.py), and count its parameters while the fake group is alive.
    PP is the outermost mesh dim, so stage s owns ranks [s * world / pp, (s + 1) * world / pp)."""
    world = plan.parallel_dims.world_size
    with fake_world(first_rank, world):
        init_logger(first_rank)
        dims = dataclasses.replace(plan.parallel_dims)  # the plan's layout, with a mesh of this fake world
        dims.build_mesh("cpu")
        # The schedule is built but never run: the plain loss stands in for the Trainer's scaled one.
        model = build_model(config, plan, dims, torch.device("cpu"), cross_entropy_sum)
        ranks = list(range(first_rank, first_rank + world // dims.pp))
        counts, distinct = _count_stage(model.parts, ranks, world)
        mesh_text = str(dims.mesh) if dims.mesh is not None else "none (1 rank)"
    return _Stage(dims, model, counts, distinct, mesh_text)


def run_dry_run(config: JobConfig) -> DryRunReport:
    world = config.job.dry_run_world_size
    # The layout is checked as for the GPUs the fake world stands in for; the tokenizer and the data
    # may live only on the cluster.
    plan = check_job(config, world, "cuda", data_here=False)
    assert plan is not None  # a world size was given
    first = _build_stage(config, plan, 0)
    dims, per_rank, distinct = first.dims, first.counts, first.distinct
    degrees = {n: getattr(dims, n) for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    stages = [_describe_stage(first.model.parts)]
    for stage in range(1, dims.pp):
        built = _build_stage(config, plan, stage * (world // dims.pp))
        stages.append(_describe_stage(built.model.parts))
        per_rank = [a + b for a, b in zip(per_rank, built.counts)]
        distinct += built.distinct
    shared, note = estimate_shared_memory(config, degrees, world)
    # The estimator's peak (rank 0's) stands for every rank of an FSDP layout; without it, model states.
    memory = [shared or estimate_rank_memory(n, config) for n in per_rank]
    return DryRunReport(
        plan,
        world,
        first.mesh_text,
        degrees,
        stages,
        first.model.num_params,
        per_rank,
        distinct,
        memory,
        note,
        plan.model_plan.transforms(len(first.model.float8_fqns)),
    )


def format_report(report: DryRunReport, config: JobConfig) -> str:
    """The plan as text: mesh, stages, then per-rank rows (ranks with equal values grouped)."""
    deg = ", ".join(f"{k} {v}" for k, v in report.degrees.items())
    lines = [
        f"dry run: {config.model.name} {config.model.flavor} on {report.world_size}"
        f" rank{'s' if report.world_size != 1 else ''}"
        " (fake process group, meta device: nothing allocated, nothing communicated)",
        f"degrees: {deg}",
        f"mesh: {report.mesh}",
        f"gradient accumulation: {report.plan.grad_accum_steps} micro-batch(es) per step",
    ]
    label = "pp rank" if len(report.stages) > 1 else "stage"
    lines += [f"{label} {i}: {text}" for i, text in enumerate(report.stages)]
    # Columns come from the estimator's keys, so a richer estimator adds columns by itself.
    keys = list(report.memory[0]) if report.memory else []
    head = f"{'ranks':>13} {'params':>16}" + "".join(f" {k + ' GiB':>12}" for k in keys) + f" {'total GiB':>10}"
    lines += [f"model transforms: {report.transforms}", "per rank, GiB (" + report.memory_note + "):", head]
    start = 0
    rows = list(zip(report.per_rank_params, report.memory))
    for r in range(1, len(rows) + 1):
        if r == len(rows) or rows[r] != rows[start]:
            n, mem = rows[start]
            span = f"{start}" if r - 1 == start else f"{start}-{r - 1}"
            cells = "".join(f" {mem[k]:>12.2f}" for k in keys)
            lines.append(f"{span:>13} {n:>16,}{cells} {sum(mem.values()):>10.2f}")
            start = r
    verdict = "matches" if report.ok else "DOES NOT MATCH"
    total = sum(report.per_rank_params)
    copies = f" ({total:,} over all ranks, replicated copies included)" if total != report.distinct_shard_params else ""
    lines.append(
        f"check: per-rank shards sum to {report.distinct_shard_params:,} parameters{copies};"
        f" {verdict} the model's {report.model_params:,}"
    )
    return "\n".join(lines)


def main(config: JobConfig) -> int:
    """Print the plan; exit status 1 when the shards do not add up to the model."""
    init_logger(0)
    log_translations(config.translations)
    report = run_dry_run(config)
    print(format_report(report, config), flush=True)
    return 0 if report.ok else 1
