"""Parallelize a deepseek_v3 model part with llama4's MoE driver (TP/SP -> EP/ETP -> AC -> compile
-> FSDP2 / HSDP / DDP; experts FSDP-sharded on their own mesh under EP): the blocks have llama4's
shape, only the attention's TP plan is latent attention's."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.models.deepseek_v3.model import DeepSeekV3Transformer
from titan.models.llama4.parallelize import parallelize_moe_family
from titan.parallel.dims import ParallelDims


def apply_tp(
    model: DeepSeekV3Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False
) -> None:
    raise TitanError(
        f'parallelism.tensor_parallel_degree = {tp_mesh.size()} is not supported for model.name = "deepseek_v3"'
        " yet; use expert (EP), data (FSDP/HSDP) or pipeline parallelism"
    )


def parallelize_deepseek_v3(
    model: DeepSeekV3Transformer, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    return parallelize_moe_family(model, parallel_dims, job_config, apply_tp, "deepseek_v3")
