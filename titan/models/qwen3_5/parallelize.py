"""Parallelize a qwen3_5 model part: llama's order and pieces for the dense flavors (TP/SP -> AC ->
compile -> FSDP/HSDP/DDP), the shared MoE driver's for the MoE ones (TP/SP -> EP/ETP -> AC ->
compile -> experts' and dense FSDP). Context parallelism is refused before this (Qwen35ModelArgs.check_parallelism).

Tensor parallelism: attention blocks take qwen3's plan (wq column-wise carries each head's gate with
it). Gated DeltaNet blocks get the sequence gathered in and reduce-scattered out like attention; the
q/k/v/z/a/b projections are column-wise (whole key and value heads per rank, the value heads of a
key head on the same rank), the convolutions' channels and A_log / dt_bias are split the same way,
the per-head norm runs on the local heads with its shared weight replicated, out_proj is row-wise.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan.config.job_config import JobConfig
from titan.log import logger
from titan.models.linear_attention import GatedDeltaNet, resolve_backend
from titan.models.llama.parallelize import block_plan, parallelize_llama
from titan.models.moe.parallelize import apply_moe_family_tp, moe_blocks, parallelize_moe_family
from titan.models.qwen3.parallelize import qk_norm_plan
from titan.models.qwen3_5.model import Qwen35Transformer
from titan.parallel.dims import ParallelDims
from titan.parallel.tp import Plan, ShardParameters
from titan.parallel.utils import blocks_of


def _deltanet_plan() -> Plan:
    plan: Plan = {k: v for k, v in block_plan().items() if not k.startswith("attention.")}
    plan |= {f"attention.in_proj_{p}": ColwiseParallel() for p in "qkvzab"}
    plan |= {f"attention.conv_{p}": ShardParameters() for p in "qkv"}
    plan["attention.norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["attention.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
    plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    return plan


def _block_plan(block: Any) -> Plan:
    if block.layer_type == "full_attention":
        return block_plan() | qk_norm_plan()
    return _deltanet_plan()


def apply_tp(
    model: Qwen35Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False
) -> None:
    """TP/SP for both kinds of block (the MoE ones through the shared MoE driver's plan: router and
    the shared expert's gate whole on every rank, their gradients summed over TP)."""
    apply_moe_family_tp(
        model, tp_mesh, _block_plan, "qwen3_5", loss_parallel=loss_parallel, enable_async_tp=enable_async_tp
    )
    for _, block in moe_blocks(model):
        if block.layer_type == "linear_attention":
            parallelize_module(block.attention, tp_mesh, ShardParameters(("A_log", "dt_bias")))


def parallelize_qwen3_5(model: Qwen35Transformer, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    args = model.model_args
    mesh = parallel_dims.mesh
    device_type = mesh.device_type if mesh is not None else "cpu"
    backend, why = resolve_backend(args.linear_attn_backend, device_type)
    for block in blocks_of(model).values():
        mixer = getattr(block, "_checkpoint_wrapped_module", block).attention
        if isinstance(mixer, GatedDeltaNet):
            mixer.backend = backend  # resolved once here: no package lookups inside compiled code
    # fla's kernels run outside torch.compile (fla marks them so): compiled blocks break the graph there.
    model.compile_fullgraph = backend != "fla"
    logger.info(f"Gated DeltaNet layers run the {backend} path ({why})")
    if args.moe_enabled:
        return parallelize_moe_family(model, parallel_dims, job_config, apply_tp, "qwen3_5")
    return parallelize_llama(model, parallel_dims, job_config, tp_fn=apply_tp)
