"""Parallelize a llama4 model part: activation checkpointing, compile and FSDP/HSDP/DDP as for
llama3 (titan/models/llama/parallelize.py), over dense and MoE blocks alike (the experts are
FSDP-sharded with the rest of their block). Tensor, context and expert parallelism of the MoE
blocks are not in this plan: they are refused here in one line."""

from __future__ import annotations

import torch.nn as nn

from titan.config.job_config import JobConfig
from titan.errors import require
from titan.models.llama.parallelize import parallelize_llama
from titan.models.llama4.model import Llama4Transformer
from titan.parallel.dims import ParallelDims


def parallelize_llama4(model: Llama4Transformer, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    par = job_config.parallelism
    for key, degree in (
        ("tensor_parallel_degree", par.tensor_parallel_degree),
        ("context_parallel_degree", par.context_parallel_degree),
    ):
        require(
            degree == 1,
            f"parallelism.{key}",
            rule=f'= {degree} is not supported for model.name = "llama4" (its plan has no tensor or'
            " context parallel layout for the MoE blocks); use data parallelism (FSDP/HSDP/DDP) and pipeline stages",
        )
    return parallelize_llama(model, parallel_dims, job_config)
