"""Pipeline parallelism: stage layout (which layers each stage holds), schedules by name or CSV.

The model-specific split (deleting modules from a meta model) is each model family's pipelining function;
this file knows only layer counts, ranks and torch.distributed.pipelining.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
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
from torch.distributed.pipelining.stage import _PipelineStageBase

from titan.config.job_config import Parallelism
from titan.errors import TitanError

SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
)
# Base classes: they carry no order of their own, only the one a CSV file gives them.
CSV_ONLY = ("PipelineScheduleSingle", "PipelineScheduleMulti")
# The modules of a pipeline split besides the layers, in forward order around them.
FIRST_MODULES, LAST_MODULES = ("tok_embeddings",), ("norm", "output")


def schedule_class(name: str) -> type[_PipelineSchedule]:
    if name.lower() not in {s.lower() for s in SCHEDULES}:
        raise TitanError(
            f"config key 'parallelism.pipeline_parallel_schedule' got {name!r}; valid: {', '.join(SCHEDULES)}"
        )
    return get_schedule_class(name)


def check_schedule_config(par: Parallelism, evaluates: bool = False) -> None:
    """The schedule against torch's names and the CSV file on disk (run by
    titan.training.checks.validate_job; the ranges are Parallelism.validate's). ``evaluates``: the
    run also runs the schedule's forward-only ``eval`` (validation)."""
    schedule_class(par.pipeline_parallel_schedule)
    if evaluates and par.pipeline_parallel_degree > 1 and is_v_schedule(par.pipeline_parallel_schedule):
        # torch 2.13's runtime hands a stage's input gradient to the adjacent stage on the same rank
        # even in eval, which has no backward: the first validation fails with an AssertionError.
        raise TitanError(
            f"validation.enable with parallelism.pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r}:"
            " torch 2.13's V-shaped schedules fail in eval (forward only); use Interleaved1F1B,"
            " InterleavedZeroBubble or 1F1B, or set validation.enable = false"
        )
    csv = par.pipeline_parallel_schedule_csv
    if csv and not os.path.isfile(csv):
        raise TitanError(f"config key 'parallelism.pipeline_parallel_schedule_csv' got {csv!r}: no such file")
    if not csv and par.pipeline_parallel_schedule.lower() in {s.lower() for s in CSV_ONLY}:
        raise TitanError(
            f"config key 'parallelism.pipeline_parallel_schedule' got {par.pipeline_parallel_schedule!r}, which runs"
            " the order of a CSV file: set parallelism.pipeline_parallel_schedule_csv, or name a schedule"
        )


def is_multi_stage(par) -> bool:
    """Multi-stage (looped) schedules run several stages per rank. As in torchtitan, the schedule's
    name decides, also when a CSV file gives the order (PipelineScheduleMulti with a CSV)."""
    return issubclass(schedule_class(par.pipeline_parallel_schedule), PipelineScheduleMulti)


def is_v_schedule(name: str) -> bool:
    return schedule_class(name) in (ScheduleZBVZeroBubble, ScheduleDualPipeV)


def num_stages(n_layers: int, pp: int, par) -> int:
    """Total (virtual) stages over all ranks: one per module_fqns_per_model_part entry; else from
    layers_per_stage, counting the embedding and the output as first/last_stage_less_layers layers
    (ceil((n_layers + first + last) / layers_per_stage)); else one stage per rank, two for looped schedules."""
    multi = is_multi_stage(par)
    lps = par.pipeline_parallel_layers_per_stage
    if par.module_fqns_per_model_part:
        stages, why = len(par.module_fqns_per_model_part), "parallelism.module_fqns_per_model_part has"
    elif lps != -1:
        units = n_layers + par.pipeline_parallel_first_stage_less_layers + par.pipeline_parallel_last_stage_less_layers
        stages = math.ceil(units / lps)
        why = (
            f"{n_layers} layers + embedding and output counted as {units - n_layers} at"
            f" pipeline_parallel_layers_per_stage {lps} make"
        )
    else:
        return pp * (2 if multi else 1)
    if stages % pp:
        raise TitanError(f"{why} {stages} pipeline stages, not a multiple of pipeline_parallel_degree {pp}")
    per_rank = stages // pp
    if not multi and per_rank != 1:
        raise TitanError(
            f"{why} {stages} pipeline stages, {per_rank} per rank, but schedule {par.pipeline_parallel_schedule}"
            " runs one stage per rank; use a looped schedule (Interleaved1F1B, ...) or fewer stages"
        )
    if is_v_schedule(par.pipeline_parallel_schedule) and per_rank != 2:
        raise TitanError(
            f"{why} {stages} pipeline stages, {per_rank} per rank, but the V-shaped schedule"
            f" {par.pipeline_parallel_schedule} runs exactly 2 per rank"
        )
    if multi and per_rank < 2:
        raise TitanError(
            f"{why} {stages} pipeline stages, 1 per rank, but schedule {par.pipeline_parallel_schedule} runs"
            " at least 2 per rank; use a single-stage schedule (1F1B, GPipe) or more stages"
        )
    return stages


def split_modules(n_layers: int, pp: int, par) -> list[list[str]]:
    """The module names of every stage (``layers.<i>``, tok_embeddings, norm, output): the given
    module_fqns_per_model_part, checked, or spread as torchtitan spreads them."""
    stages = num_stages(n_layers, pp, par)
    if par.module_fqns_per_model_part:
        return check_module_split(par.module_fqns_per_model_part, n_layers)
    return spread_modules(
        n_layers, stages, par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
    )


def spread_modules(n_layers: int, stages: int, first_less: int = 1, last_less: int = 1) -> list[list[str]]:
    """Stages of (nearly) equal units: the embedding counts as `first_less` layers and norm +
    output as `last_less`, so the first and last stage hold that many layers fewer; the remainder
    goes one unit each to the first stages. 6 layers over 8 stages: the embedding alone, one layer
    each, then norm + output alone."""
    units = n_layers + first_less + last_less
    base, extra = divmod(units, stages)
    if base == 0 or first_less > base or last_less > base:
        raise TitanError(
            f"model n_layers ({n_layers}) cannot be split into {stages} pipeline stages: with the embedding"
            f" counted as {first_less} layer(s) and the output as {last_less} (parallelism.pipeline_parallel_first/"
            f"last_stage_less_layers) a stage gets {base} unit(s) or {base + 1}, and the first and last stages"
            " need at least their own modules' count; lower parallelism.pipeline_parallel_degree (or raise"
            " pipeline_parallel_layers_per_stage)"
        )
    parts, layer = [], 0
    for s in range(stages):
        count = base + (s < extra) - (first_less if s == 0 else 0) - (last_less if s == stages - 1 else 0)
        names = [f"layers.{i}" for i in range(layer, layer + count)]
        layer += count
        parts.append([*FIRST_MODULES, *names] if s == 0 else [*names, *LAST_MODULES] if s == stages - 1 else names)
    return parts


def check_module_split(parts: list[list[str]], n_layers: int) -> list[list[str]]:
    """Stages run one after another, so the parts concatenated must be the model's modules in
    forward order, each once: tok_embeddings, layers.0 .. layers.<n-1>, norm, output."""
    order = [*FIRST_MODULES, *(f"layers.{i}" for i in range(n_layers)), *LAST_MODULES]
    flat = [name for part in parts for name in part]
    if flat != order or not all(parts):
        raise TitanError(
            f"config key 'parallelism.module_fqns_per_model_part' got {parts!r}; valid: non-empty lists that"
            f" together name tok_embeddings, layers.0 .. layers.{n_layers - 1}, norm, output once each, in that order"
        )
    return [list(part) for part in parts]


def stage_ids_this_rank(pp_rank: int, pp: int, stages: int, v_style: bool) -> list[int]:
    """Loop placement: rank r owns r, r+pp, ...; V placement (ZBV/DualPipeV): r and 2pp-1-r,
    so the last stage sits beside the first on rank 0."""
    per_rank = stages // pp
    if v_style:
        if per_rank != 2:
            raise TitanError(f"V-shaped schedules need exactly 2 stages per rank, got {per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def describe_stage(names: list[str]) -> str:
    """'layers 0-2 + embedding', 'layer 5 + output+loss', 'embedding', ..."""
    layers = [int(n.split(".", 1)[1]) for n in names if n.startswith("layers.")]
    pieces = []
    if layers:
        pieces.append(f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}")
    if "tok_embeddings" in names:
        pieces.append("embedding")
    if "output" in names:
        pieces.append("output+loss")
    elif "norm" in names:
        pieces.append("norm")
    if "mtp" in names:
        pieces.append("multi-token prediction")
    return " + ".join(pieces)


def describe_split(n_layers: int, parts: list[list[str]]) -> str:
    """One line naming the modules of every stage (logged at start-up)."""
    stages = "; ".join(f"stage {s}: {describe_stage(names)}" for s, names in enumerate(parts))
    return f"pipeline split of {n_layers} layers into {len(parts)} stages: {stages}"


def build_schedule(stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable, par) -> _PipelineSchedule:
    """The schedule by name, or with a CSV file torch's runtime running the file's order (any
    schedule name then only sets the stages per rank, as in torchtitan); gradients are *not*
    scaled by the schedule: the loss function already normalises by the global token count."""
    csv = par.pipeline_parallel_schedule_csv
    name = csv or par.pipeline_parallel_schedule
    runtime: _PipelineScheduleRuntime | None = None
    schedule: _PipelineSchedule
    try:
        if csv:
            schedule = runtime = _PipelineScheduleRuntime(
                stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False
            )
        else:
            cls = schedule_class(par.pipeline_parallel_schedule)
            if issubclass(cls, PipelineScheduleSingle):
                schedule = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
            elif issubclass(cls, PipelineScheduleMulti):
                local: list[_PipelineStageBase] = list(stages)  # torch types the (invariant) base-class list
                schedule = cls(local, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
            else:  # every schedule torch names derives from one of the two
                raise TypeError(f"{cls.__name__} is neither a single- nor a multi-stage pipeline schedule")
    except ValueError as e:
        # Raised identically on every rank before any pipeline communication: no hang.
        raise TitanError(
            f"pipeline schedule {name} rejects {n_microbatches} micro-batches (training.local_batch_size /"
            f" parallelism.pipeline_parallel_microbatch_size) for {len(stages)} local stage(s): {e}"
        ) from e
    if runtime is not None:
        try:
            runtime._load_csv(csv)
        except (ValueError, RuntimeError, AssertionError, KeyError) as e:  # the same file on every rank: no hang
            text = str(e).strip()
            first_line = (
                f"it names stage {text}, which the run lacks"
                if isinstance(e, KeyError)
                else text.splitlines()[0]
                if text
                else type(e).__name__
            )
            raise TitanError(
                f"config key 'parallelism.pipeline_parallel_schedule_csv' got {csv!r}, which does not fit"
                f" {len(stages) * par.pipeline_parallel_degree} stages x {n_microbatches} micro-batches: {first_line}"
            ) from e
    return schedule


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Whatever the block writes into the buffers of ``module`` (routing counts, largest logits, ...)
    is undone at its end: each buffer it modified gets its old value back, in place, and a buffer
    it replaced is put back. Buffers the block left alone are not written (the autograd graph of
    the block may have saved them, e.g. the RoPE table)."""
    saved: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
    slots = []
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is not None:
                slots.append((owner, name, buf))
                if id(buf) not in saved:
                    saved[id(buf)] = (buf, buf._version, buf.detach().clone())
    try:
        yield
    finally:
        for owner, name, buf in slots:
            if owner._buffers.get(name) is not buf:
                owner._buffers[name] = buf
        with torch.no_grad():
            for buf, version, value in saved.values():
                if buf._version != version:
                    buf.copy_(value)


class Stage(PipelineStage):
    """torch's PipelineStage, whose shape inference leaves no trace in the model part.

    Given no example inputs/outputs, torch 2.13's PipelineStage learns its shapes when the schedule
    first runs (``step`` or ``eval``) and again at every switch between the two (validation, then
    training): before the real micro-batches, every stage of the pipeline runs its part once more,
    the first stage on a copy of micro-batch 0 and every other one on uninitialised tensors
    (torch.empty) of the shapes its predecessor sends, in the part's current mode (training under
    ``step``) and under a forked RNG; under ``step`` with grad enabled, followed by
    ``torch.autograd.grad`` towards the stage's inputs only (the last stage through the loss
    function), which leaves the parameters' gradients alone. What forwards accumulate in buffers
    would take that pass in (the MoE layers' routing counts, QK-clip's largest logits): both
    halves run inside ``buffers_kept``.

    titan does not hand the stages their shapes instead (which would skip the pass): a boundary's
    dtype follows mixed precision (FSDP's param dtype, autocast), its shape TP's sequence sharding
    and CP, validation's batch may be another size, and the last stage's output can be a DTensor
    (loss parallel), for which torch then wants the gradients' layouts as well. Restating all that
    is where an error would hide; the pass costs one micro-batch's forward and input backward per
    stage at each switch.
    """

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with buffers_kept(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with buffers_kept(self.submod):
            return super()._backward_metadata_inference(*args, **kwargs)


def make_stages(parts: Sequence[nn.Module], stage_ids: list[int], stages: int, device, group) -> list[PipelineStage]:
    return [Stage(m, sid, stages, device, group=group) for m, sid in zip(parts, stage_ids)]
