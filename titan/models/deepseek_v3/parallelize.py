"""Parallelize a deepseek_v3 model part with llama4's MoE driver (TP/SP -> EP/ETP -> CP -> AC ->
compile -> FSDP2 / HSDP / DDP; experts FSDP-sharded on their own mesh under EP): the blocks have
llama4's shape, only the attention's TP plan is latent attention's."""

from __future__ import annotations

import torch.nn as nn

from titan.config.job_config import JobConfig
from titan.models.deepseek_v3.model import DeepSeekV3Transformer
from titan.models.llama.parallelize import apply_llama_cp
from titan.models.llama4.parallelize import parallelize_moe_family
from titan.parallel.dims import ParallelDims


def parallelize_deepseek_v3(
    model: DeepSeekV3Transformer, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    # TP is refused before this by DeepSeekV3ModelArgs.check_parallelism (the run plan's check).
    # CP: latent attention reaches its kernel as llama's Attention does (q/k of qk_head_dim, v of
    # v_head_dim: ring SDPA and flex's gathered k/v take each at its own width).
    return parallelize_moe_family(model, parallel_dims, job_config, None, "deepseek_v3", cp_fn=apply_llama_cp)
