"""Split a meta-device Llama into pipeline stages, parallelize each, and build the schedule."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from titan.config.job_config import JobConfig
from titan.log import logger
from titan.models.llama.model import Transformer
from titan.models.llama.parallelize import enabled_submesh
from titan.models.mtp import mtp_stage_modules
from titan.parallel.dims import ParallelDims
from titan.parallel.pp_layout import describe_split, describe_stage, is_v_schedule, split_modules, stage_ids_this_rank

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule


def split_stage(model: Transformer, names: list[str]) -> Transformer:
    """A copy of the (meta) model keeping only the modules `names` (``layers.<i>``,
    tok_embeddings, norm, output, mtp). Layer keys keep their global index so FQNs (checkpoints,
    seeded init) are the same as in the unsplit model."""
    part = copy.deepcopy(model)
    keep = set(names)
    for name in list(part.layers.keys()):
        if f"layers.{name}" not in keep:
            del part.layers[name]
    for name in ("tok_embeddings", "norm", "output", "mtp"):
        if name not in keep:
            setattr(part, name, None)
    return part


def pipeline_llama(
    model: Transformer,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    parallelize_fn: Callable,
    loss_fn: Callable,
) -> tuple[_PipelineSchedule, list[nn.Module], bool, bool]:
    """(schedule, model_parts, has_first_stage, has_last_stage)"""
    # torch's pipelining runtime imports torch._dynamo (over a second of CPU): only pipelined runs
    # import it, not every process that looks up a model family (the pre-check does).
    from titan.parallel.pp import build_schedule, make_stages

    par = job_config.parallelism
    pp_mesh = enabled_submesh(parallel_dims, "pp")
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    split = mtp_stage_modules(split_modules(model.n_layers, pp, par), model.model_args)
    stages = len(split)
    ids = stage_ids_this_rank(pp_rank, pp, stages, is_v_schedule(par.pipeline_parallel_schedule))
    parts = [parallelize_fn(split_stage(model, split[sid]), parallel_dims, job_config) for sid in ids]
    pp_stages = make_stages(parts, ids, stages, device, pp_mesh.get_group())
    n_micro = job_config.training.local_batch_size // par.pipeline_parallel_microbatch_size
    schedule = build_schedule(pp_stages, n_micro, loss_fn, par)
    logger.info(describe_split(model.n_layers, split))
    logger.info(
        f"pipeline rank {pp_rank}/{pp}: stages {ids} of {stages}"
        f" ({'; '.join(describe_stage(split[s]) for s in ids)}), {n_micro} micro-batches,"
        f" schedule {par.pipeline_parallel_schedule}"
        + (f" ({par.pipeline_parallel_schedule_csv})" if par.pipeline_parallel_schedule_csv else "")
    )
    has_first = any(s.is_first for s in pp_stages)
    has_last = any(s.is_last for s in pp_stages)
    return schedule, parts, has_first, has_last
