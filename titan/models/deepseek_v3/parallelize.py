"""Parallelize a deepseek_v3 model part with the shared MoE driver (TP/SP -> EP/ETP -> CP -> AC ->
compile -> FSDP2 / HSDP / DDP; experts FSDP-sharded on their own mesh under EP): the blocks have llama4's
shape, only the attention's TP plan is latent attention's.

Under TP the attention's input is gathered over the sequence; the low-rank down projections
(``wq_a``, ``wkv_a``) and their norms run whole on every rank, the up projections (``wq`` or
``wq_b``, ``wkv_b``) are column-wise so each rank computes its shard of the heads, and ``wo`` is
row-wise, reduce-scattered back to sequence shards (torchtitan's plan). The rotary key, shared by
all heads, gets on each rank the gradient of its own heads only: the plan sums it over TP."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan.config.job_config import JobConfig
from titan.models.deepseek_v3.model import DeepSeekV3Transformer
from titan.models.llama.parallelize import apply_llama_cp, block_plan
from titan.models.moe.parallelize import apply_moe_family_tp, parallelize_moe_family
from titan.parallel.dims import ParallelDims
from titan.parallel.expert_parallel import NoParallel
from titan.parallel.tp import Plan, SumGradOverTP


def _mla_plan(block: Any) -> Plan:
    """llama's block plan (norms, dense FFN) with latent attention's in place of llama's attention."""
    plan = {k: v for k, v in block_plan().items() if k != "attention" and not k.startswith("attention.")}
    # Plain tensors inside attention: every projection below converts its own input and output.
    plan["attention"] = PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
    )
    if block.attention.q_lora_rank == 0:
        plan["attention.wq"] = ColwiseParallel()
    else:
        plan |= {"attention.wq_a": NoParallel(), "attention.q_norm": NoParallel(), "attention.wq_b": ColwiseParallel()}
    plan |= {
        "attention.wkv_a": NoParallel(),
        "attention.kv_norm": NoParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.shared_rope_key": SumGradOverTP(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    return plan


def apply_tp(
    model: DeepSeekV3Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False
) -> None:
    """TP/SP for latent attention, dense FFNs, router and shared experts; the routed experts are
    the MoE driver's apply_experts' (ETP or TP)."""
    apply_moe_family_tp(
        model, tp_mesh, _mla_plan, "deepseek_v3", loss_parallel=loss_parallel, enable_async_tp=enable_async_tp
    )


def parallelize_deepseek_v3(
    model: DeepSeekV3Transformer, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    # CP: latent attention reaches its kernel as llama's Attention does (q/k of qk_head_dim, v of
    # v_head_dim: ring SDPA and flex's gathered k/v take each at its own width).
    return parallelize_moe_family(model, parallel_dims, job_config, apply_tp, "deepseek_v3", cp_fn=apply_llama_cp)
