"""Parallelize a gpt_oss model part with the shared MoE driver (TP/SP -> EP/ETP -> AC -> compile ->
FSDP2 / HSDP / DDP; experts FSDP-sharded on their own mesh under EP).

The TP/SP plan is llama's with gpt-oss's attention: the embedding row-wise (output sharded on the
sequence), norms sequence-parallel, the output column-wise (loss parallel); wq/wk/wv column-wise
with their biases and wo row-wise, whole heads per rank, and the learned sinks split on heads like
wq's output, so each rank's heads keep their own sink (both attention kernels read the local
shard). The MoE block gathers the sequence in and reduce-scatters its partial output; the router
runs whole on every rank; the routed experts are split on their hidden dim by TP (or by ETP under
EP), each rank adding 1 / TP of the down-projection bias. gpt-oss scales the experts' OUTPUTS by
the router scores, so each rank's score gradient is a partial sum: it is summed over TP in the
backward pass (titan.parallel.tp.SumGradOverTP) before it reaches the replicated router.

Context parallelism is refused: the sink softmax needs every key of a query's window on one rank.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from titan.config.job_config import JobConfig
from titan.log import logger
from titan.models.gpt_oss.model import GptOssTransformer
from titan.models.llama.parallelize import block_plan, root_plan
from titan.models.moe.parallelize import moe_blocks, parallelize_moe_family, with_moe_plan
from titan.parallel.dims import ParallelDims
from titan.parallel.tp import apply_tp_plan


def apply_tp(
    model: GptOssTransformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False
) -> None:
    """TP/SP for attention (sinks with their heads), norms, embedding, output and the MoE blocks'
    router; the routed experts are the MoE driver's apply_experts' (TP or ETP). The shapes were checked by
    GptOssModelArgs.check_parallelism."""
    apply_tp_plan(model, tp_mesh, root_plan(model, loss_parallel), [], {}, enable_async_tp=enable_async_tp)
    for _, block in moe_blocks(model):
        parallelize_module(block, tp_mesh, with_moe_plan(block_plan(), block))
        attention: Any = block.attention
        # Heads are contiguous in wq's output: Shard(0) of the sinks gives each rank its heads' sinks.
        attention.sinks = nn.Parameter(distribute_tensor(attention.sinks, tp_mesh, [Shard(0)]))
        attention.sinks_sharded = True
    model.seq_shards = tp = tp_mesh.size()
    logger.info(f"applied tensor + sequence parallel to gpt_oss (degree {tp}, loss parallel {loss_parallel})")


def parallelize_gpt_oss(model: GptOssTransformer, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    # CP is refused before this by GptOssModelArgs.check_parallelism (the run plan's check).
    return parallelize_moe_family(model, parallel_dims, job_config, apply_tp, "gpt_oss")
