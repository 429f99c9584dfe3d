"""Parallelize a gpt_oss model part with llama4's MoE pieces, in the same order: EP -> activation
checkpointing -> compile -> FSDP2 / HSDP / DDP (experts FSDP-sharded on their own mesh under EP).

Tensor parallelism is refused: gpt-oss scales the experts' OUTPUTS by the router scores, so under
TP each rank's score gradient would be a partial sum while the router's weights are replicated,
and the experts' down-projection bias would be added once per TP rank. Context parallelism is
refused: the sink softmax needs every key of a query's window on one rank.
"""

from __future__ import annotations

from typing import Any, cast

import torch.nn as nn

from titan.config.job_config import JobConfig
from titan.models.gpt_oss.model import GptOssTransformer
from titan.models.llama.parallelize import enabled_submesh
from titan.models.llama4.parallelize import apply_experts, apply_llama4_fsdp, compile_blocks
from titan.parallel.ac import apply_ac
from titan.parallel.dims import ParallelDims
from titan.parallel.fsdp import apply_ddp


def parallelize_gpt_oss(model: GptOssTransformer, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    # TP and CP are refused before this by GptOssModelArgs.check_parallelism (the run plan's check).
    # llama4's MoE plans read only what both families' blocks have (attention, norms, moe, moe_enabled).
    shared = cast(Any, model)
    apply_experts(shared, parallel_dims)
    ac = job_config.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if job_config.compile.enable and "model" in job_config.compile.components:
        compile_blocks(shared)
    if parallel_dims.fsdp_enabled:
        apply_llama4_fsdp(shared, parallel_dims, job_config)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, enabled_submesh(parallel_dims, "dp_replicate"))
    return model
