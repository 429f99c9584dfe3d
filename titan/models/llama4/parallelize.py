"""Parallelize a llama4 model part with the shared MoE driver (titan/models/moe/parallelize.py:
TP/SP -> EP/ETP -> CP -> AC -> compile -> FSDP2 / HSDP / DDP; experts FSDP-sharded on their own mesh
under EP). llama4's own part is the TP plan of its blocks, llama3's, and its CP hooks, llama3's too
(iRoPE flavors are refused CP before this by Llama4ModelArgs.check_parallelism)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titan.config.job_config import JobConfig
from titan.models.llama.parallelize import apply_llama_cp, block_plan
from titan.models.llama4.model import Llama4Transformer
from titan.models.moe.parallelize import apply_moe_family_tp, parallelize_moe_family
from titan.parallel.dims import ParallelDims
from titan.parallel.tp import Plan


def _llama_block_plan(block: Any) -> Plan:
    return block_plan()


def apply_tp(
    model: Llama4Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False
) -> None:
    """TP/SP for attention, dense FFNs, router and shared experts; the routed experts are the MoE
    driver's apply_experts' (ETP or TP). Scores applied before or after the experts both train: the
    MoE plan sums the scores' gradient over TP when they weight the experts' partial outputs."""
    apply_moe_family_tp(
        model, tp_mesh, _llama_block_plan, "llama4", loss_parallel=loss_parallel, enable_async_tp=enable_async_tp
    )


def parallelize_llama4(model: Llama4Transformer, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    return parallelize_moe_family(model, parallel_dims, job_config, apply_tp, "llama4", cp_fn=apply_llama_cp)
