"""Pipeline parallelism's runtime: the stages and the schedule, with torch.distributed.pipelining.

What each stage holds and which schedules exist (known from the config alone) is
titan.parallel.pp_layout; the model-specific split (deleting modules from a meta model) is each
model family's pipelining function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from titan.errors import TitanError
from titan.parallel.pp_layout import schedule_kind


def schedule_class(name: str) -> type[_PipelineSchedule]:
    """torch's schedule class for a name titan accepts (refused in one line otherwise)."""
    schedule_kind(name)
    return get_schedule_class(name)


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
