"""Parallelize a llama4 model part with the shared MoE driver (titan/models/moe/parallelize.py:
TP/SP -> EP/ETP -> CP -> AC -> compile -> FSDP2 / HSDP / DDP; experts FSDP-sharded on their own mesh
under EP). llama4's own part is the TP plan of its blocks, llama3's, and its CP hooks, llama3's too
(iRoPE flavors are refused CP before this by Llama4ModelArgs.check_parallelism)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.models.llama.parallelize import apply_llama_cp, block_plan
from titan.models.llama4.model import Llama4Transformer
from titan.models.moe.parallelize import apply_moe_family_tp, parallelize_moe_family
from titan.parallel.dims import ParallelDims
from titan.parallel.tp import Plan, check_tp_shapes


def _llama_block_plan(block: Any) -> Plan:
    return block_plan()


def apply_tp(
    model: Llama4Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False
) -> None:
    """TP/SP for attention, dense FFNs, router and shared experts; the routed experts are the MoE
    driver's apply_experts' (ETP or TP)."""
    tp = tp_mesh.size()
    args = model.model_args
    check_tp_shapes(args.n_heads, args.kv_heads, tp)
    if not args.moe_args.score_before_experts:
        # The router's scores would then multiply TP-partial expert outputs: their gradient would be
        # partial on each TP rank while the router's weights are replicated.
        raise TitanError(
            "parallelism.tensor_parallel_degree > 1 needs moe_args.score_before_experts = true for llama4"
            " (scores applied to the experts' inputs); use data parallelism and pipeline stages instead"
        )
    apply_moe_family_tp(
        model, tp_mesh, _llama_block_plan, "llama4", loss_parallel=loss_parallel, enable_async_tp=enable_async_tp
    )


def parallelize_llama4(model: Llama4Transformer, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    return parallelize_moe_family(model, parallel_dims, job_config, apply_tp, "llama4", cp_fn=apply_llama_cp)
