"""Pipeline parallelism: stage layout (which layers each stage holds), schedules by name or CSV.

The model-specific split (deleting modules from a meta model) is each model family's pipelining function;
this file knows only layer counts, ranks and torch.distributed.pipelining.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

from titan.errors import TitanError

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def schedule_class(name: str) -> type[_PipelineSchedule]:
    if name.lower() not in {s.lower() for s in SCHEDULES}:
        raise TitanError(f"config key 'parallelism.pipeline_parallel_schedule' got {name!r}; valid: {', '.join(SCHEDULES)}")
    return get_schedule_class(name)


def check_schedule_config(par, local_batch_size: int) -> None:  # noqa: ANN001 - config.Parallelism
    """Checks needing only the config (run by titan.training.checks.validate_job)."""
    schedule_class(par.pipeline_parallel_schedule)
    csv = par.pipeline_parallel_schedule_csv
    if csv and not os.path.isfile(csv):
        raise TitanError(f"config key 'parallelism.pipeline_parallel_schedule_csv' got {csv!r}: no such file")
    mbs = par.pipeline_parallel_microbatch_size
    if par.pipeline_parallel_degree > 1 and local_batch_size % mbs:
        raise TitanError(
            f"config key 'training.local_batch_size' ({local_batch_size}) must be a multiple of"
            f" parallelism.pipeline_parallel_microbatch_size ({mbs})"
        )


def is_multi_stage(par) -> bool:  # noqa: ANN001
    """Multi-stage (looped) schedules run several stages per rank; CSV schedules always are."""
    if par.pipeline_parallel_schedule_csv:
        return True
    return issubclass(schedule_class(par.pipeline_parallel_schedule), PipelineScheduleMulti)


def is_v_schedule(name: str) -> bool:
    return schedule_class(name) in (ScheduleZBVZeroBubble, ScheduleDualPipeV)


def num_stages(n_layers: int, pp: int, par) -> int:  # noqa: ANN001
    """Total stages over all ranks, from layers_per_stage (or the default); checked to fit."""
    multi = is_multi_stage(par)
    lps = par.pipeline_parallel_layers_per_stage
    if lps == -1:
        stages = pp * (2 if multi else 1)
        if stages > n_layers:
            raise TitanError(
                f"model n_layers ({n_layers}) cannot be split into {stages} pipeline stages"
                f" (pipeline_parallel_degree {pp}{' x 2 stages per rank' if multi else ''}): every stage"
                " needs at least one layer; lower parallelism.pipeline_parallel_degree, or set"
                " parallelism.pipeline_parallel_layers_per_stage"
            )
        return stages
    if n_layers % lps:
        raise TitanError(
            f"parallelism.pipeline_parallel_layers_per_stage ({lps}) must divide model n_layers ({n_layers})"
        )
    stages = n_layers // lps
    if stages % pp:
        raise TitanError(
            f"{n_layers} layers at {lps} per stage make {stages} stages, not a multiple of"
            f" pipeline_parallel_degree {pp}; change pipeline_parallel_layers_per_stage"
        )
    if not multi and stages != pp:
        raise TitanError(
            f"schedule {par.pipeline_parallel_schedule} runs one stage per rank but"
            f" {n_layers} layers at {lps} per stage make {stages} stages for {pp} ranks;"
            " use a looped schedule (Interleaved1F1B, ...) or fewer layers per stage"
        )
    return stages


def stage_ids_this_rank(pp_rank: int, pp: int, stages: int, v_style: bool) -> list[int]:
    """Loop placement: rank r owns r, r+pp, ...; V placement (ZBV/DualPipeV): r and 2pp-1-r,
    so the last stage sits beside the first on rank 0."""
    per_rank = stages // pp
    if v_style:
        if per_rank != 2:
            raise TitanError(f"V-shaped schedules need exactly 2 stages per rank, got {per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def stage_layer_counts(n_layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible: n_layers // stages each, and the remainder one
    layer at a time to the middle stages first, as they hold neither the embedding nor the output
    projection + loss. Among them the later ones come first: under 1F1B-style schedules stage s
    keeps about (stages - s) micro-batches of activations in flight, so a layer more costs less
    memory late in the pipeline. Only when every middle stage has one does the first stage get
    one: its embedding is a lookup, while the last stage's output projection over the vocabulary
    and the loss cost more than a layer. So the last stage never holds more layers than any other."""
    base, extra = divmod(n_layers, stages)
    counts = [base] * stages
    for s in [*range(stages - 2, 0, -1), 0][:extra]:
        counts[s] += 1
    return counts


def layers_of_stage(stage: int, stages: int, n_layers: int) -> list[int]:
    counts = stage_layer_counts(n_layers, stages)
    start = sum(counts[:stage])
    return list(range(start, start + counts[stage]))


def describe_split(n_layers: int, stages: int) -> str:
    """One line naming the layers of every stage (logged at start-up)."""
    parts = []
    for s in range(stages):
        layers = layers_of_stage(s, stages, n_layers)
        span = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
        ends = [e for e, on in (("embedding", s == 0), ("output+loss", s == stages - 1)) if on]
        parts.append(f"stage {s}: layers {span}" + "".join(f" + {e}" for e in ends))
    return f"pipeline split of {n_layers} layers into {stages} stages: " + "; ".join(parts)


def build_schedule(
    stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, par  # noqa: ANN001
) -> _PipelineSchedule:
    """The schedule by name, or the CSV runtime; gradients are *not* scaled by the schedule:
    the loss function already normalises by the global token count."""
    name = par.pipeline_parallel_schedule_csv or par.pipeline_parallel_schedule
    try:
        if par.pipeline_parallel_schedule_csv:
            schedule = _PipelineScheduleRuntime(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
            schedule._load_csv(par.pipeline_parallel_schedule_csv)
            return schedule
        cls = schedule_class(par.pipeline_parallel_schedule)
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except ValueError as e:
        # Raised identically on every rank before any pipeline communication: no hang.
        raise TitanError(
            f"pipeline schedule {name} rejects {n_microbatches} micro-batches (training.local_batch_size /"
            f" parallelism.pipeline_parallel_microbatch_size) for {len(stages)} local stage(s): {e}"
        ) from e


def make_stages(
    parts: list[nn.Module], stage_ids: list[int], stages: int, device, group  # noqa: ANN001
) -> list[PipelineStage]:
    return [PipelineStage(m, sid, stages, device, group=group) for m, sid in zip(parts, stage_ids)]
