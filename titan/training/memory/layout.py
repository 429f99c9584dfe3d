"""What one rank of a layout holds: its blocks, and its parameters as the layout shards them.

The rank's model is built as the trainer builds it (titan.training.build.build_model: float8,
pipeline split, TP/SP, EP/ETP, CP, activation checkpointing, FSDP/HSDP/DDP) on the meta device,
inside a fake process group where this process is the rank (nothing is allocated or sent), with
one block of each kind per pipeline stage: blocks of one kind (same modules, parameter shapes and
settings; DeepSeek-V3's dense and MoE blocks, gpt-oss's sliding and full attention) are sharded
alike, so the rank's totals are the built blocks' times how many of each it holds. Each FSDP unit
(a block, the root, an experts module under EP, a chunked loss's output) gives the bytes this rank
keeps (padded shards), the unit's all-gather output (unsharded on this rank's TP/EP slice, in the
gathered dtype: bf16, or fp8 for float8 weights gathered in float8) and its reduce-scatter input
(the same elements in the reduce dtype). Parameters outside FSDP (DDP, TP alone, one rank) are
held whole on their slice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan.config.job_config import JobConfig
from titan.log import logger
from titan.parallel.ac import parse_selective_option
from titan.parallel.fake_world import fake_world
from titan.parallel.pp_layout import is_v_schedule, stage_ids_this_rank
from titan.training.plan import RunPlan

__all__ = ["RankModel", "Unit", "block_signature", "build_rank"]

ROOT = -1
"""The unit key of everything outside the blocks (embedding, final norm, output)."""


@dataclass
class Unit:
    """Bytes of a group of parameters on this rank. ``held``: the parameters it keeps (padded shards
    in their dtype), ``numel`` their elements; ``gathered``: FSDP's all-gather output (0 outside
    FSDP); ``reduce``: FSDP's reduce-scatter input; ``shards``: the FSDP shard group's size."""

    held: int = 0
    numel: int = 0
    gathered: int = 0
    reduce: int = 0
    grad: int = 0  # the unsharded gradient of its elements on this rank, in the dtype backward makes it
    shards: int = 1
    replicas: int = 1  # HSDP: the replicate group the sharded gradients are all-reduced over
    fsdp: bool = False

    def add(self, other: Unit) -> None:
        self.held += other.held
        self.numel += other.numel
        self.gathered += other.gathered
        self.reduce += other.reduce
        self.grad += other.grad
        self.shards, self.replicas = max(self.shards, other.shards), max(self.replicas, other.replicas)
        self.fsdp = self.fsdp or other.fsdp


@dataclass
class RankModel:
    """``stages``: this rank's pipeline stages (stage index -> its layer ids, in order; one stage
    without PP); ``kind``: layer id -> the built block standing for it; ``units``: per built block
    (and ``ROOT``), its FSDP units (or loose parameters, ``fsdp`` False) on this rank; ``buffers``:
    bytes of model buffers per built block and ROOT; ``parts``: the built parts (meta)."""

    stages: dict[int, list[int]]
    kind: dict[int, int]
    units: dict[int, list[Unit]]
    buffers: dict[int, int]
    has_first: bool
    has_last: bool
    order: list[tuple[str, int, int]] | None  # pipeline actions (type, stage, micro-batch); None without PP
    parts: list[nn.Module] = field(default_factory=list)
    moe: set[int] = field(default_factory=set)  # layer ids of the MoE blocks
    whole: set[str] = field(default_factory=set)  # modules (by name in a block) computed whole on every TP rank
    numel: dict[int, int] = field(default_factory=dict)  # trainable elements of each whole block, and ROOT's
    muon_step: int = 0  # Muon's step buffers (titan/training/memory/optimizer.py)

    @property
    def blocks(self) -> list[int]:
        return [i for ids in self.stages.values() for i in ids]

    def windows(self) -> dict[int, int]:
        """Layer id -> the block whose measured windows stand for it (titan/training/memory/profile.py):
        the model's first and last block stand for themselves (their neighbours are the embedding and
        the head), every other block for the first of its kind that is neither."""
        blocks = self.blocks
        ends = {blocks[0] if self.has_first else None, blocks[-1] if self.has_last else None}
        inner: dict[int, int] = {}
        for i in blocks:
            if i not in ends:
                inner.setdefault(self.kind[i], i)
        return {i: i if i in ends else inner[self.kind[i]] for i in blocks}

    def count(self, built: int) -> int:
        """How many of this rank's blocks the built block ``built`` stands for."""
        return sum(1 for i in self.blocks if self.kind[i] == built)

    def total(self, what: str) -> int:
        """Sum of a Unit field over the rank (built blocks times their counts, plus the root)."""
        out = sum(getattr(u, what) for u in self.units.get(ROOT, []))
        for built, units in self.units.items():
            if built != ROOT:
                out += self.count(built) * sum(getattr(u, what) for u in units)
        return out


def block_signature(block: nn.Module) -> tuple:
    """Blocks with equal signatures cost the same: submodule types, parameter shapes, plain settings."""
    out = []
    for name, m in block.named_modules():
        settings = sorted(
            (k, v)
            for k, v in vars(m).items()
            if not k.startswith("_") and "layer_id" not in k and isinstance(v, (bool, int, float, str, type(None)))
        )
        shapes = tuple(tuple(p.shape) for p in m.parameters(recurse=False))
        out.append((name, type(m).__name__, shapes, tuple(settings)))
    return tuple(out)


def rank_stages(config: JobConfig, plan: RunPlan, rank: int) -> dict[int, list[int]]:
    """Stage index -> layer ids of each pipeline stage ``rank`` holds (stage 0 holds all without PP)."""
    dims, stages = plan.parallel_dims, plan.model_plan.stages
    ids = [0]
    if dims.pp > 1:
        pp_rank = rank // (dims.world_size // dims.pp)
        ids = stage_ids_this_rank(
            pp_rank, dims.pp, len(stages), is_v_schedule(config.parallelism.pipeline_parallel_schedule)
        )
    return {s: [int(n.split(".", 1)[1]) for n in stages[s] if n.startswith("layers.")] for s in ids}


def block_kinds(
    config: JobConfig, plan: RunPlan, stages: dict[int, list[int]]
) -> tuple[dict[int, int], set[int], dict[int, int]]:
    """Layer id -> the first block of its stage with the same signature (and, with AC on every N-th
    block, the same checkpointing); the layer ids of the MoE blocks; each block's trainable
    elements (whole) and, under ROOT, the rest of the model's."""
    with torch.device("meta"):
        model = plan.spec.model_cls(plan.model_args)
    ac = config.activation_checkpoint
    every = parse_selective_option(ac.selective_ac_option) if ac.mode == "selective" else None
    kind: dict[int, int] = {}
    for ids in stages.values():
        seen: dict[tuple, int] = {}
        for i in ids:
            key = (block_signature(model.layers[str(i)]), i % every == 0 if isinstance(every, int) else None)
            kind[i] = seen.setdefault(key, i)
    moe = {i for i in kind if getattr(model.layers[str(i)], "moe_enabled", False)}
    numel = {i: sum(p.numel() for p in model.layers[str(i)].parameters() if p.requires_grad) for i in kind}
    numel[ROOT] = sum(p.numel() for p in model.parameters() if p.requires_grad) - sum(
        sum(p.numel() for p in b.parameters() if p.requires_grad) for b in model.layers.values()
    )
    return kind, moe, numel


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The build logs what it applies; the estimate says it once itself."""
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _owner(name: str) -> int:
    """The layer id of a module or parameter name, ROOT outside the blocks."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" else ROOT


def _fsdp_unit(module: Any) -> Unit | None:
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return None
    unit = Unit(fsdp=True)
    mp = group.mp_policy  # FSDPParam's own dtypes are set at the first forward
    for fp in group.fsdp_params:
        numel = fp.padded_sharded_param_size.numel()
        local = fp.sharded_param.to_local() if isinstance(fp.sharded_param, DTensor) else fp.sharded_param
        shards = fp.mesh_info.shard_mesh_size
        orig = local.dtype
        gathered = mp.param_dtype or orig
        # float8 weights gathered in float8 (torchao's pre-all-gather hook casts the shard first)
        item = 1 if type(local).__name__ == "WeightWithDynamicFloat8CastTensor" else None
        reduce = mp.reduce_dtype or gathered
        unit.add(
            Unit(
                held=numel * orig.itemsize,
                numel=numel,
                gathered=numel * shards * (item or gathered.itemsize),
                reduce=numel * shards * reduce.itemsize,
                grad=numel * shards * gathered.itemsize,
                shards=shards,
                replicas=getattr(fp.mesh_info, "replicate_mesh_size", 1),
                fsdp=True,
            )
        )
    return unit


def _units(parts: list[nn.Module]) -> tuple[dict[int, list[Unit]], dict[int, int]]:
    units: dict[int, list[Unit]] = {}
    managed: set[int] = set()
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, FSDPModule):
                unit = _fsdp_unit(module)
                if unit is not None:
                    units.setdefault(_owner(name), []).append(unit)
                    group = module._get_fsdp_state()._fsdp_param_group
                    assert group is not None  # _fsdp_unit found it
                    managed.update(id(fp.sharded_param) for fp in group.fsdp_params)
    buffers: dict[int, int] = {}
    for part in parts:
        loose: dict[int, Unit] = {}
        for name, p in part.named_parameters():
            if id(p) in managed:
                continue
            local = p.to_local() if isinstance(p, DTensor) else p
            loose.setdefault(_owner(name), Unit()).add(
                Unit(
                    held=local.numel() * local.element_size(),
                    numel=local.numel(),
                    grad=local.numel() * local.element_size(),
                )
            )
        for owner, unit in loose.items():
            units.setdefault(owner, []).append(unit)
        for name, b in part.named_buffers():
            local = b.to_local() if isinstance(b, DTensor) else b
            buffers[_owner(name)] = buffers.get(_owner(name), 0) + local.numel() * local.element_size()
    return units, buffers


def _whole_over_tp(parts: list[nn.Module]) -> set[str]:
    """Names, inside a block, of the modules TP runs whole on every rank (NoParallel: a router's gate,
    latent attention's down-projections and their norms)."""
    out = set()
    for part in parts:
        for name, module in part.named_modules():
            if getattr(module, "computed_whole_over_tp", False) and name.startswith("layers."):
                inner = name.split(".", 2)[2].replace("_checkpoint_wrapped_module.", "")
                out.add(inner)
    return out


_ACTIONS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def _order(schedule: Any, pp_rank: int) -> list[tuple[str, int, int]] | None:
    """The rank's pipeline actions as (F | B | I | W | other, stage, micro-batch). By the enum's
    name: its str() is "F" in some torch versions and "_ComputationType.FORWARD" in others."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return None
    return [
        (
            _ACTIONS.get(str(a.computation_type.name), str(a.computation_type.name)),
            a.stage_index,
            a.microbatch_index or 0,
        )
        for a in order.get(pp_rank, [])
        if a is not None
    ]


def build_rank(config: JobConfig, plan: RunPlan, rank: int) -> RankModel:
    """Rank ``rank`` of the plan's world, built on meta in a fake process group (one block per kind
    and stage)."""
    from titan.training.build import build_model
    from titan.training.loss import cross_entropy_sum

    stages = rank_stages(config, plan, rank)
    kind, moe, numel = block_kinds(config, plan, stages)
    keep = sorted(set(kind.values()))
    dims = plan.parallel_dims
    with fake_world(rank, dims.world_size), _quiet():
        built_dims = dataclasses.replace(dims)
        built_dims.build_mesh("cpu")
        built = build_model(config, plan, built_dims, torch.device("cpu"), cross_entropy_sum, keep_layers=keep)
        units, buffers = _units(built.parts)
        whole = _whole_over_tp(built.parts)
        pp_rank = rank // (dims.world_size // dims.pp)
        order = _order(built.pp_schedule, pp_rank) if built.pp_schedule is not None else None
        muon = _muon_step(config, built.parts)  # Muon's plan reads the meshes: inside the fake world
    has = (built.pp_has_first, built.pp_has_last)
    return RankModel(stages, kind, units, buffers, *has, order, built.parts, moe, whole, numel, muon)


def _muon_step(config: JobConfig, parts: list[nn.Module]) -> int:
    """Muon's step buffers on this rank as titan.training.muon.muon_memory plans them (0: AdamW)."""
    from titan.training.muon import muon_memory

    o = config.optimizer
    if o.name.lower() != "muon":
        return 0
    return max(muon_memory(part, None, o.ns_steps, o.muon_router_gate)["optimizer_aux"] for part in parts)
