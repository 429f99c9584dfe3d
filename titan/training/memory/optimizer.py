"""The optimizer's bytes on one rank: its state (moments, momentum) and its step's temporaries.

Counted on the rank's built parts (titan/training/memory/layout.py), each parameter as many times as
the blocks its built block stands for. A state tensor is made like its parameter (``zeros_like`` of
the local shard, unpadded), in fp32.

AdamW (and Adam): two moments per element. The step's temporaries by implementation: foreach makes
one fp32 copy of a whole parameter group (``_foreach_sqrt`` of the second moments; groups step one
after another), for-loop two copies of the largest parameter, fused none.

Muon: one momentum buffer per matrix element and AdamW's two moments for the rest; its step's
buffers as titan.training.muon.muon_memory plans them for the built parts (the pieces sent, the
matrices owned, stacks and Newton-Schulz buffers; one block of each kind stands for its kind, so
the plan is the built blocks'); its AdamW part steps after it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan.config.job_config import JobConfig
from titan.training.memory.layout import ROOT, RankModel

__all__ = ["optimizer_bytes"]

_FP32 = 4


def _local_numel(p: torch.Tensor) -> int:
    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def _owner_counts(rank: RankModel, part: nn.Module) -> dict[int, int]:
    """id(parameter) -> how many of the rank's parameters it stands for."""
    out: dict[int, int] = {}
    for name, p in part.named_parameters():
        pieces = name.split(".")
        owner = int(pieces[1]) if len(pieces) > 1 and pieces[0] == "layers" else ROOT
        out[id(p)] = 1 if owner == ROOT else rank.count(owner)
    return out


def _counted(rank: RankModel) -> Iterator[tuple[nn.Module, nn.Parameter, int]]:
    for part in rank.parts:
        counts = _owner_counts(rank, part)
        for p in part.parameters():
            if p.requires_grad:
                yield part, p, counts[id(p)]


def _adamw_step(rank: RankModel, config: JobConfig, skip: set[int]) -> int:
    from titan.training.optim import param_groups, resolve_implementation

    impl = resolve_implementation(config.optimizer)
    if impl == "fused":
        return 0
    if impl == "for-loop":
        return max((2 * _FP32 * _local_numel(p) for _, p, _ in _counted(rank) if id(p) not in skip), default=0)
    largest = 0
    for part in rank.parts:
        counts = _owner_counts(rank, part)
        params = [p for p in part.parameters() if p.requires_grad and id(p) not in skip]
        for group in param_groups(part, config.optimizer.weight_decay_exclude, params) if params else []:
            largest = max(largest, sum(_local_numel(p) * counts[id(p)] for p in group["params"]))
    return _FP32 * largest


def optimizer_bytes(rank: RankModel, config: JobConfig) -> tuple[int, int, str]:
    """(optimizer_state, optimizer_aux, what the state holds) in bytes on this rank."""
    from titan.training.muon import split_muon_params

    if config.optimizer.name.lower() != "muon":
        state = sum(2 * _FP32 * _local_numel(p) * n for _, p, n in _counted(rank))
        return state, _adamw_step(rank, config, set()), "AdamW, 2 x fp32"
    router_gate = config.optimizer.muon_router_gate
    matrices: set[int] = set()
    step = rank.muon_step  # planned while the rank was built (titan/training/memory/layout.py)
    for part in rank.parts:
        found, _ = split_muon_params(part, router_gate)
        matrices.update(id(p) for p in found)
    state = sum((1 if id(p) in matrices else 2) * _FP32 * _local_numel(p) * n for _, p, n in _counted(rank))
    step = max(step, _adamw_step(rank, config, matrices))
    return state, step, "Muon 1 x fp32 on matrices, AdamW 2 x fp32 on the rest"
