"""Apply parallelisms to a Llama model part, in this fixed order:
TP/SP -> CP -> activation checkpointing -> compile -> FSDP2 / HSDP / DDP.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan.config.job_config import JobConfig
from titan.parallel.ac import apply_ac
from titan.parallel.compile import apply_compile
from titan.parallel.cp import apply_cp
from titan.parallel.dims import ParallelDims
from titan.parallel.fsdp import apply_ddp, apply_fsdp
from titan.parallel.tp import apply_tp as _apply_tp


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False) -> None:
    """Tensor + sequence parallel over `tp_mesh` (see titan/parallel/tp.py). With loss_parallel
    the logits are vocab-sharded DTensors: run the loss under tensor.parallel.loss_parallel()."""
    _apply_tp(model, tp_mesh, loss_parallel=loss_parallel, enable_async_tp=enable_async_tp)


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    par = job_config.parallelism
    if parallel_dims.tp_enabled:
        apply_tp(
            model,
            parallel_dims.submesh("tp"),
            loss_parallel=parallel_dims.loss_parallel_enabled,
            enable_async_tp=par.enable_async_tensor_parallel,
        )
    if parallel_dims.cp_enabled:
        apply_cp(model, parallel_dims.submesh("cp"), job_config.model.attn_type)
    ac = job_config.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if job_config.compile.enable and "model" in job_config.compile.components:
        apply_compile(model)
    if parallel_dims.fsdp_enabled:
        # HSDP: replicate across the outer dim, shard inside; plain FSDP: one shard dim.
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            param_dtype=job_config.training.mixed_precision_param,
            reduce_dtype=job_config.training.mixed_precision_reduce,
            reshard_after_forward=par.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.submesh("dp_replicate"))
    return model
