"""Parallelize any MoE family's model part, in llama3's order: TP/SP -> EP/ETP -> CP (families whose
attention allows it) -> activation checkpointing -> compile -> FSDP2 / HSDP / DDP.

A family brings its TP plan for attention, norms and dense feed-forwards (llama's names) and its CP
hooks; the rest is shared. In an MoE block under TP the layer's input is gathered over the sequence
and its output reduce-scattered back (torchtitan's layout): the router runs whole on every TP rank,
the shared expert is column/row-wise like a dense FFN, and the routed experts are split by EP
(experts over the ``ep`` ranks, tokens moved by all-to-all), by ETP (each expert's hidden dim over TP
as well) or, without EP, by TP alone. When the router's scores weight the experts' outputs
(``score_before_experts = false``) each TP rank's gradient of them is partial: it is summed over TP
before it reaches the replicated router. Under EP the experts are FSDP-sharded on their own mesh
(efsdp), the rest of the block on the dense one.

The blocks have llama4's shape: ``attention``, ``attention_norm``, ``ffn_norm``, ``moe_enabled``
and ``moe`` (an MoE block) or ``feed_forward`` (a dense one).
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
from titan.models.llama.parallelize import enabled_submesh, root_plan
from titan.models.moe.balance import moe_layers
from titan.parallel.ac import apply_ac
from titan.parallel.compile import wait_async_output
from titan.parallel.cp import cp_sum
from titan.parallel.dims import ParallelDims
from titan.parallel.expert_parallel import (
    ExpertParallel,
    ExpertTensorParallel,
    NoParallel,
    apply_experts_fsdp,
    log_experts_layout,
)
from titan.parallel.fsdp import DTYPES, apply_ddp, apply_fsdp, reshard_policy
from titan.parallel.tp import Plan, SumGradOverTP, apply_tp_plan, check_tp_shapes
from titan.parallel.utils import blocks_of

DENSE_FFN = ("feed_forward", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
"""A block plan's dense feed-forward entries (llama's names), which an MoE block replaces."""


def moe_blocks(model: nn.Module) -> list[tuple[str, Any]]:
    """(layer id, block) with any AC wrapper looked through."""
    return [(name, getattr(b, "_checkpoint_wrapped_module", b)) for name, b in blocks_of(model).named_children()]


def moe_tp_plan(block: Any) -> Plan:
    """The TP plan of an MoE block's ``moe`` layer: sequence gathered in, partial sums reduce-scattered
    out, the router whole on every rank, the shared expert column/row-wise. The routed experts are
    apply_experts'."""
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
    if not block.moe.score_before_experts:
        # The scores then weight the experts' TP-partial outputs: each rank's gradient of them is
        # partial, summed over TP before it reaches the replicated router.
        plan["moe.router"] = SumGradOverTP(output_index=0)
    if getattr(block.moe, "shared_gate", None) is not None:
        # The gate scales the shared expert's TP-partial output: computed whole on every rank, its
        # gradient summed over TP (apply_moe_family_tp adds the sum).
        plan["moe.shared_gate"] = NoParallel()
    if block.moe.shared_experts is not None:
        plan["moe.shared_experts.w1"] = ColwiseParallel()
        plan["moe.shared_experts.w2"] = RowwiseParallel(output_layouts=Partial())
        plan["moe.shared_experts.w3"] = ColwiseParallel()
    return plan


def with_moe_plan(plan: Plan, block: Any) -> Plan:
    """``plan`` (a block plan with llama's names) with its dense feed-forward entries replaced by the
    MoE layer's in an MoE block; unchanged in a dense one."""
    if not block.moe_enabled:
        return plan
    return {k: v for k, v in plan.items() if k not in DENSE_FFN} | moe_tp_plan(block)


def apply_moe_family_tp(
    model: Any,
    tp_mesh: DeviceMesh,
    block_plan: Callable[[Any], Plan],
    family: str,
    *,
    loss_parallel: bool,
    enable_async_tp: bool = False,
) -> None:
    """llama's root plan, then each block's: ``block_plan(block)`` (attention, norms and a dense
    FFN, llama's names) with the dense FFN's entries replaced by the MoE plan in MoE blocks. Whole
    heads per rank (the run plan's check refused other degrees first)."""
    check_tp_shapes(model.model_args.n_heads, model.model_args.kv_heads, tp_mesh.size())
    apply_tp_plan(model, tp_mesh, root_plan(model, loss_parallel), [], {}, enable_async_tp=enable_async_tp)
    for _, block in moe_blocks(model):
        parallelize_module(block, tp_mesh, with_moe_plan(block_plan(block), block))
        if block.moe_enabled and getattr(block.moe, "shared_gate", None) is not None:
            parallelize_module(block.moe.shared_gate, tp_mesh, SumGradOverTP())
    model.seq_shards = tp_mesh.size()
    logger.info(
        f"applied tensor + sequence parallel to {family} (degree {tp_mesh.size()}, loss parallel {loss_parallel})"
    )


def apply_experts(model: nn.Module, dims: ParallelDims) -> None:
    """EP (experts over ep), EP x ETP, or TP alone on every MoE block's routed experts."""
    if not (dims.ep_enabled or dims.tp_enabled):
        return
    # EP with TP but ETP 1 is refused before this, by check_layout (titan.parallel.dims.check_experts).
    assert not (dims.ep_enabled and dims.tp_enabled and not dims.etp_enabled), "EP x TP needs ETP = TP"
    for _, block in moe_blocks(model):
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


def compile_moe_blocks(model: Any) -> None:
    """Dense blocks compile whole; an MoE block compiles its attention, norms, router and shared
    expert, leaving the routing glue and the routed experts eager (token counts decide shapes, and
    EP's all-to-all needs its split sizes on the host)."""
    compiled = 0
    # A model whose blocks call kernels outside torch.compile (fla's) says so: graph breaks there.
    fullgraph = getattr(model, "compile_fullgraph", True)
    for wrapper in blocks_of(model).values():
        block: Any = getattr(wrapper, "_checkpoint_wrapped_module", wrapper)
        if not block.moe_enabled:
            wrapper.compile(fullgraph=fullgraph)  # the AC wrapper, if any, with its block
            compiled += 1
            continue
        for child in (block.attention, block.attention_norm, block.ffn_norm, block.moe.router):
            child.compile(fullgraph=fullgraph)
        if block.moe.shared_experts is not None:
            block.moe.shared_experts.compile(fullgraph=fullgraph)
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(wait_async_output)
    logger.info(f"compiled {compiled} dense blocks whole and the MoE blocks' parts but the routed experts")


def apply_moe_fsdp(model: Any, dims: ParallelDims, job_config: JobConfig) -> None:
    """FSDP2 / HSDP: each MoE block's routed experts first, in a unit of their own, where the
    block's unit would shard them badly: under EP on the experts' mesh (efsdp); without EP (and TP)
    when the FSDP ranks outnumber the experts, whose dim 0 would pad to a whole expert per rank,
    on the dense mesh with their hidden dim sharded. Then the blocks and the root on the dense mesh."""
    par, t = job_config.parallelism, job_config.training
    num_experts = model.model_args.moe_args.num_experts
    mesh, ep = (dims.experts_fsdp_mesh(), dims.ep) if dims.ep_enabled else (dims.fsdp_mesh(), 1)
    assert mesh is not None, "FSDP is on (this is its pass): ParallelDims built the mesh the experts take"
    if dims.ep_enabled or (not dims.tp_enabled and mesh.size(mesh.ndim - 1) > num_experts):
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
        for _, block in moe_blocks(model):
            if block.moe_enabled:
                apply_experts_fsdp(block.moe.experts, mesh, num_experts, ep, **kwargs)
    apply_fsdp(
        model,
        dims.fsdp_mesh(),
        param_dtype=t.mixed_precision_param,
        reduce_dtype=t.mixed_precision_reduce,
        reshard_after_forward=par.fsdp_reshard_after_forward,
        pp_enabled=dims.pp_enabled,
        cpu_offload=t.enable_cpu_offload,
    )


def apply_moe_cp(model: Any, cp_mesh: DeviceMesh, attn_type: str, cp_fn: Callable) -> None:
    """CP on an MoE family: ``cp_fn`` hooks the attention kernels (llama's apply_llama_cp's
    signature); every MoE layer's sequence-wise balance loss sums its per-sequence counts over the
    CP ranks. The routing counts of the auxiliary-loss-free balancing are summed over dp x cp by
    the trainer (titan/training/moe.py)."""
    cp_fn(model, cp_mesh, attn_type)
    seq_sum = cp_sum(cp_mesh)
    for _, moe in moe_layers([model]):
        moe.seq_shards, moe.seq_sum = cp_mesh.size(), seq_sum


def parallelize_moe_family(
    model: Any,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    tp_fn: Callable | None,
    family: str,
    cp_fn: Callable | None = None,
) -> nn.Module:
    """The order above (CP after EP/ETP) for a family whose blocks have llama4's shape; ``tp_fn`` is
    the family's TP/SP plan (llama's ``apply_tp``'s signature; None: the family has none), ``cp_fn``
    its CP hooks (``apply_llama_cp``'s; None: the attention does not allow CP)."""
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
    apply_experts(model, parallel_dims)
    if parallel_dims.cp_enabled:
        if cp_fn is None:  # the run plan's check refuses it first (the family's check_parallelism)
            raise TitanError(
                f"parallelism.context_parallel_degree = {par.context_parallel_degree} is not supported for"
                f' model.name = "{family}"; use tensor, expert, data or pipeline parallelism'
            )
        apply_moe_cp(model, enabled_submesh(parallel_dims, "cp"), job_config.model.attn_type, cp_fn)
    compiled = job_config.compile.enable and "model" in job_config.compile.components
    # The whole section: per-op SAC's force-recomputed shapes (the router's gate by default), the
    # checkpoint wrapper's options and the memory budget, as for dense models.
    apply_ac(model, job_config.activation_checkpoint, compiled=compiled, dump_folder=job_config.job.dump_folder)
    if compiled:
        compile_moe_blocks(model)
    if parallel_dims.fsdp_enabled:
        apply_moe_fsdp(model, parallel_dims, job_config)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, enabled_submesh(parallel_dims, "dp_replicate"))
    return model


__all__ = [
    "DENSE_FFN",
    "apply_experts",
    "apply_moe_cp",
    "apply_moe_family_tp",
    "apply_moe_fsdp",
    "compile_moe_blocks",
    "moe_blocks",
    "moe_tp_plan",
    "parallelize_moe_family",
    "with_moe_plan",
]
