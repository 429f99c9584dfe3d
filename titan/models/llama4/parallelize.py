"""Parallelize a llama4 model part, in llama3's order: TP/SP -> EP/ETP -> activation checkpointing
-> compile -> FSDP2 / HSDP / DDP.

TP/SP shards attention and the dense feed-forward as llama3's plan does. In an MoE block the layer's
input is gathered over the sequence and its output reduce-scattered back (torchtitan's layout): the
router runs whole on every TP rank, the shared expert is column/row-wise like a dense FFN, and the
routed experts are split by EP (experts over the ``ep`` ranks, tokens moved by all-to-all), by ETP
(each expert's hidden dim over TP as well) or, without EP, by TP alone. Under EP the experts are
FSDP-sharded on their own mesh (efsdp), the rest of the block on the dense one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    parallelize_module,
)

from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.log import logger
from titan.models.llama.parallelize import _block_plan, _root_plan, enabled_submesh
from titan.models.llama4.model import Llama4Transformer
from titan.parallel.ac import apply_ac
from titan.parallel.compile import _wait_async_output as wait_async_output
from titan.parallel.dims import ParallelDims
from titan.parallel.expert_parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    NoParallel,
    ScoreGradOverTP,
    apply_experts_fsdp,
    log_experts_layout,
)
from titan.parallel.fsdp import DTYPES, apply_ddp, apply_fsdp, reshard_policy
from titan.parallel.tp import Plan, apply_tp_plan, check_tp_shapes
from titan.parallel.utils import blocks_of

_DENSE_FFN = ("feed_forward", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def _blocks(model: nn.Module) -> list[tuple[str, Any]]:
    """(layer id, block) with any AC wrapper looked through."""
    return [(name, getattr(b, "_checkpoint_wrapped_module", b)) for name, b in blocks_of(model).named_children()]


def _moe_plan(block: Any) -> Plan:
    plan: Plan = {
        # All-gather the sequence in, reduce-scatter the partial sums of shared + routed experts out.
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),),
        ),
        "moe.router.gate": NoParallel(),
    }
    if not block.moe.score_before_experts:  # scores times TP-partial outputs: their gradient is partial
        plan["moe.router"] = ScoreGradOverTP()
    if block.moe.shared_experts is not None:
        plan["moe.shared_experts.w1"] = ColwiseParallel()
        plan["moe.shared_experts.w2"] = RowwiseParallel(output_layouts=Partial())
        plan["moe.shared_experts.w3"] = ColwiseParallel()
    return plan


def apply_tp(
    model: Llama4Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False
) -> None:
    """TP/SP for attention, dense FFNs, router and shared experts; the routed experts are
    apply_experts' (ETP or TP)."""
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
    apply_tp_plan(model, tp_mesh, _root_plan(model, loss_parallel), [], {}, enable_async_tp=enable_async_tp)
    for _, block in _blocks(model):
        plan = _block_plan()
        if block.moe_enabled:
            plan = {k: v for k, v in plan.items() if k not in _DENSE_FFN} | _moe_plan(block)
        parallelize_module(block, tp_mesh, plan)
    model.seq_shards = tp
    logger.info(f"applied tensor + sequence parallel to llama4 (degree {tp}, loss parallel {loss_parallel})")


def apply_experts(model: Llama4Transformer, dims: ParallelDims) -> None:
    """EP (experts over ep), EP x ETP, or TP alone on every MoE block's routed experts."""
    if not (dims.ep_enabled or dims.tp_enabled):
        return
    if dims.ep_enabled and dims.tp_enabled and not dims.etp_enabled:
        raise TitanError(
            "parallelism.expert_tensor_parallel_degree = 1 with tensor_parallel_degree"
            f" {dims.tp} and expert_parallel_degree {dims.ep} is not supported by titan's llama4 plan (EP would have"
            f" to split each TP group's tokens); set expert_tensor_parallel_degree = {dims.tp}"
        )
    for _, block in _blocks(model):
        if not block.moe_enabled:
            continue
        if dims.ep_enabled:
            names = ("ep", "etp") if dims.etp_enabled else ("ep",)
            mesh = dims.sparse_submesh(names)
            assert mesh is not None, "EP is on: ParallelDims built the experts' mesh"
            parallelize_module(block.moe.experts, mesh, ExpertParallel())
        else:
            parallelize_module(block.moe.experts, enabled_submesh(dims, "tp"), ExpertTensorParallel())
    if dims.ep_enabled:
        log_experts_layout(dims.ep, dims.etp if dims.etp_enabled else 1, dims.efsdp)


def compile_blocks(model: Llama4Transformer) -> None:
    """Dense blocks compile whole; an MoE block compiles its attention, norms, router and shared
    expert, leaving the routing glue and the routed experts eager (token counts decide shapes, and
    EP's all-to-all needs its split sizes on the host)."""
    compiled = 0
    for wrapper in blocks_of(model).values():
        block: Any = getattr(wrapper, "_checkpoint_wrapped_module", wrapper)
        if not block.moe_enabled:
            wrapper.compile(fullgraph=True)  # the AC wrapper, if any, with its block
            compiled += 1
            continue
        for child in (block.attention, block.attention_norm, block.ffn_norm, block.moe.router):
            child.compile(fullgraph=True)
        if block.moe.shared_experts is not None:
            block.moe.shared_experts.compile(fullgraph=True)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(wait_async_output)
    logger.info(f"compiled {compiled} dense blocks whole and the MoE blocks' parts but the routed experts")


def apply_llama4_fsdp(model: Llama4Transformer, dims: ParallelDims, job_config: JobConfig) -> None:
    par, t = job_config.parallelism, job_config.training
    if dims.ep_enabled:
        mesh = dims.experts_fsdp_mesh()
        assert mesh is not None, "EP is on: ParallelDims built the experts' mesh"
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        kwargs = dict(
            mp_policy=MixedPrecisionPolicy(
                param_dtype=DTYPES[t.mixed_precision_param], reduce_dtype=DTYPES[t.mixed_precision_reduce]
            ),
            reshard_after_forward=reshard_policy(par.fsdp_reshard_after_forward, dims.pp_enabled),
            offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
            if t.enable_cpu_offload
            else OffloadPolicy(),
        )
        for _, block in _blocks(model):
            if block.moe_enabled:
                experts = block.moe.experts
                apply_experts_fsdp(experts, mesh, model.model_args.moe_args.num_experts, dims.ep, **kwargs)
    apply_fsdp(
        model,
        dims.fsdp_mesh(),
        param_dtype=t.mixed_precision_param,
        reduce_dtype=t.mixed_precision_reduce,
        reshard_after_forward=par.fsdp_reshard_after_forward,
        pp_enabled=dims.pp_enabled,
        cpu_offload=t.enable_cpu_offload,
    )


def parallelize_llama4(model: Llama4Transformer, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    return parallelize_moe_family(model, parallel_dims, job_config, apply_tp, "llama4")


def parallelize_moe_family(
    model: Any, parallel_dims: ParallelDims, job_config: JobConfig, tp_fn: Callable | None, family: str
) -> nn.Module:
    """The order above for any family whose blocks are llama4's shape (``attention``,
    ``attention_norm``, ``ffn_norm``, ``moe_enabled`` and ``moe`` or ``feed_forward``); ``tp_fn``
    is the family's TP/SP plan (``apply_tp``'s signature)."""
    par = job_config.parallelism
    if parallel_dims.tp_enabled:
        if tp_fn is None:  # the run plan's check refuses it first (the family's check_parallelism)
            raise TitanError(f'model.name = "{family}" has no tensor-parallel plan')
        tp_fn(
            model,
            enabled_submesh(parallel_dims, "tp"),
            loss_parallel=parallel_dims.loss_parallel_enabled,
            enable_async_tp=par.enable_async_tensor_parallel,
        )
    ac = job_config.activation_checkpoint  # with EP, per-op selective AC is refused by the run plan's check_run
    apply_experts(model, parallel_dims)
    if parallel_dims.cp_enabled:
        # The iRoPE block masks and the MoE routing statistics are not split along the sequence.
        raise TitanError(
            f"parallelism.context_parallel_degree = {par.context_parallel_degree} is not supported for"
            f' model.name = "{family}" with MoE blocks; use tensor, expert, data or pipeline parallelism'
        )
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if job_config.compile.enable and "model" in job_config.compile.components:
        compile_blocks(model)
    if parallel_dims.fsdp_enabled:
        apply_llama4_fsdp(model, parallel_dims, job_config)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, enabled_submesh(parallel_dims, "dp_replicate"))
    return model
