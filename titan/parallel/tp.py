"""Tensor + sequence parallelism for Llama blocks (parallelize_module plans), and async TP.

Sequence parallel is always on with TP: between blocks the residual stream is sharded on the
sequence dim, so the RMSNorm weights become DTensors (Replicate) like every other parameter.
Without it they stay plain tensors next to DTensors, which breaks grad clipping and foreach
optimizers (seen on CPU/gloo with torch 2.13).
"""

from __future__ import annotations

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

from titan.errors import TitanError
from titan.log import logger


def _root_plan(model: nn.Module, loss_parallel: bool) -> dict:
    plan: dict = {}
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


_BLOCK_PLAN = {
    "attention_norm": SequenceParallel(),
    # block_mask (a kwarg) passes through untouched; freqs_cis stays a plain full-length tensor.
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


def check_tp_shapes(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Colwise q/k/v split whole heads across TP ranks: both head counts must divide."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if value % tp:
            raise TitanError(
                f"parallelism.tensor_parallel_degree {tp} must divide model {name} ({value});"
                " pick a degree that divides both head counts"
            )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False) -> None:
    """Shard a Llama model (or pipeline stage) over `tp_mesh` with sequence parallelism.

    With `loss_parallel` the output projection returns vocab-sharded DTensor logits: compute
    the loss (and its backward) under `torch.distributed.tensor.parallel.loss_parallel()`.
    Without it the logits are gathered into an ordinary full tensor.
    """
    tp = tp_mesh.size()
    args = model.model_args
    check_tp_shapes(args.n_heads, args.kv_heads, tp)
    if enable_async_tp:
        enable_async_tensor_parallel(tp_mesh)
    parallelize_module(model, tp_mesh, _root_plan(model, loss_parallel))
    # Sequence parallel: blocks see 1/tp of the sequence, attention the gathered whole (the flex
    # mask is built for that length).
    model.seq_shards = tp
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _BLOCK_PLAN)
    logger.info(f"applied tensor + sequence parallel (degree {tp}, loss parallel {loss_parallel}, async {enable_async_tp})")


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Async TP overlaps the TP collectives with matmuls via symmetric memory (CUDA only); the
    fused kernels come from compile's micro-pipeline pass, so blocks must also be compiled."""
    if tp_mesh.device_type != "cuda":
        raise TitanError(
            "parallelism.enable_async_tensor_parallel needs CUDA (it uses symmetric memory between"
            f" GPUs); this run's device is {tp_mesh.device_type}: set it to false"
        )
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True

