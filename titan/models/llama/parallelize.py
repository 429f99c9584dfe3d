"""Parallelize a Llama model part, in this fixed order:
TP/SP -> CP -> activation checkpointing -> compile -> FSDP2 / HSDP / DDP.

The Llama-specific parts live here (the TP/SP plan, the CP hook points, the RoPE table that
follows the sequence under CP); titan/parallel supplies the mechanisms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from titan.config.job_config import JobConfig
from titan.log import logger
from titan.models.llama.flex import causal_mask_mod
from titan.models.llama.model import Attention, Transformer
from titan.models.mtp import mtp_tp_plan
from titan.parallel.ac import apply_ac, recomputed_attention_breaks_compile
from titan.parallel.compile import apply_compile
from titan.parallel.cp import SeqBuffer, apply_cp, cp_mask_builder
from titan.parallel.dims import ParallelDims
from titan.parallel.fsdp import apply_ddp, apply_fsdp
from titan.parallel.tp import Plan, apply_tp_plan, check_tp_shapes


def root_plan(model: nn.Module, loss_parallel: bool) -> Plan:
    """Plan for the modules a pipeline stage may lack (embedding, final norm, output, the MTP parts)."""
    plan: Plan = mtp_tp_plan(model, SequenceParallel)
    if getattr(model, "tok_embeddings", None) is not None:
        # Every TP rank holds a slice of the vocab; the output comes back sharded on sequence.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        # Loss parallel keeps logits sharded on vocab: cross entropy then never gathers them.
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def block_plan() -> Plan:
    # Built per call: ParallelStyle objects are not shared between models.
    return {
        "attention_norm": SequenceParallel(),
        # block_mask and the KV cache (kwargs) pass through untouched; freqs_cis stays a plain
        # full-length tensor.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def enabled_submesh(dims: ParallelDims, name: str) -> DeviceMesh:
    """The mesh of a dimension the caller has checked is enabled (submesh is None only for size 1)."""
    mesh = dims.submesh(name)
    if mesh is None:
        raise RuntimeError(f"parallel dimension {name!r} is enabled but the device mesh has no such dimension")
    return mesh


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False) -> None:
    """Shard a Llama model (or pipeline stage) over `tp_mesh` with sequence parallelism.

    With `loss_parallel` the output projection returns vocab-sharded DTensor logits: compute
    the loss (and its backward) under `torch.distributed.tensor.parallel.loss_parallel()`.
    Without it the logits are gathered into an ordinary full tensor.
    """
    tp = tp_mesh.size()
    check_tp_shapes(model.model_args.n_heads, model.model_args.kv_heads, tp)
    apply_tp_plan(
        model,
        tp_mesh,
        root_plan(model, loss_parallel),
        model.layers.values(),
        block_plan(),
        enable_async_tp=enable_async_tp,
    )
    # Sequence parallel: blocks see 1/tp of the sequence, attention the gathered whole (the flex
    # mask is built for that length).
    model.seq_shards = tp
    logger.info(
        f"applied tensor + sequence parallel (degree {tp}, loss parallel {loss_parallel}, async {enable_async_tp})"
    )


def apply_llama_cp(model: Transformer, cp_mesh: DeviceMesh, attn_type: str) -> None:
    """CP hooks every block's attention kernel (Attention.inner_attention); with flex the model's
    mask cache builds the CP (local query rows) causal mask instead of the plain one."""
    if attn_type == "flex":
        assert model.block_masks is not None, "a flex model builds its block-mask cache"
        model.block_masks.set_builder(cp_mask_builder(causal_mask_mod, cp_mesh))
    # Before AC and compile wrap the blocks: each block's Attention is reached by its type.
    apply_cp([m.inner_attention for m in model.layers.modules() if isinstance(m, Attention)], cp_mesh, attn_type)


def cp_buffers(model: Transformer) -> list[SeqBuffer]:
    """Buffers indexed by position that CP shards with the batch: the RoPE table (dim 0)."""
    return [(model, "freqs_cis", 0)]


def parallelize_llama(
    model: Transformer, parallel_dims: ParallelDims, job_config: JobConfig, tp_fn: Callable = apply_tp
) -> nn.Module:
    """``tp_fn``: the family's TP/SP plan (a family on llama's skeleton passes its own)."""
    par = job_config.parallelism
    if parallel_dims.tp_enabled:
        tp_fn(
            model,
            enabled_submesh(parallel_dims, "tp"),
            loss_parallel=parallel_dims.loss_parallel_enabled,
            enable_async_tp=par.enable_async_tensor_parallel,
        )
    if parallel_dims.cp_enabled:
        apply_llama_cp(model, enabled_submesh(parallel_dims, "cp"), job_config.model.attn_type)
    compiled = job_config.compile.enable and "model" in job_config.compile.components
    device_type = enabled_submesh(parallel_dims, "tp").device_type if parallel_dims.tp_enabled else "cpu"
    keep_attention = recomputed_attention_breaks_compile(device_type, parallel_dims.tp_enabled, compiled)
    apply_ac(
        model,
        job_config.activation_checkpoint,
        compiled=compiled,
        keep_attention=keep_attention,
        dump_folder=job_config.job.dump_folder,
    )
    if compiled:
        # A model whose blocks call kernels outside torch.compile (fla's) says so: graph breaks there.
        fullgraph = getattr(model, "compile_fullgraph", True)
        apply_compile(model, before_blocks=model.tok_embeddings, fullgraph=fullgraph)  # None on later PP stages
    if parallel_dims.fsdp_enabled:
        # HSDP: replicate across the outer dim, shard inside; plain FSDP: one shard dim.
        apply_fsdp(
            model,
            parallel_dims.fsdp_mesh(),
            param_dtype=job_config.training.mixed_precision_param,
            reduce_dtype=job_config.training.mixed_precision_reduce,
            reshard_after_forward=par.fsdp_reshard_after_forward,
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, enabled_submesh(parallel_dims, "dp_replicate"))
    return model
