"""Apply parallelisms to a Llama model part, in the order DESIGN.md fixes:
TP/SP -> CP -> activation checkpointing -> compile -> FSDP2 / HSDP / DDP.
"""

from __future__ import annotations

import torch.nn as nn

from titan.config.job_config import JobConfig
from titan.parallel.ac import apply_ac
from titan.parallel.compile import apply_compile
from titan.parallel.dims import ParallelDims
from titan.parallel.fsdp import apply_ddp, apply_fsdp


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    ac = job_config.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if job_config.compile.enable and "model" in job_config.compile.components:
        apply_compile(model)

    if parallel_dims.fsdp_enabled:
        # HSDP: replicate across the outer dim, shard inside; plain FSDP: one shard dim.
        names = ("dp_replicate", "dp_shard_cp") if parallel_dims.dp_replicate_enabled else ("dp_shard_cp",)
        mesh = parallel_dims.mesh[names] if len(names) > 1 else parallel_dims.submesh(names[0])
        apply_fsdp(
            model,
            mesh,
            param_dtype=job_config.training.mixed_precision_param,
            reduce_dtype=job_config.training.mixed_precision_reduce,
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.submesh("dp_replicate"))
    return model
