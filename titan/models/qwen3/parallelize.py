"""Parallelize a qwen3 model part: llama's order and pieces for the dense flavors (TP/SP -> CP -> AC
-> compile -> FSDP/HSDP/DDP), the shared MoE driver's for the MoE ones (titan/models/moe/parallelize.py:
TP/SP -> EP/ETP -> CP -> AC -> compile -> experts' and dense FSDP), each with qwen3's TP plan.

The plan differs from llama's in the q/k norms: they act per head on the output of the column-wise
wq / wk, so each TP rank runs them on its own heads. Their weights become replicated DTensors and
their input is read as sharded on the head dimension (``SequenceParallel(sequence_dim=2)``): the
weights' gradients, partial per rank, are then summed over TP like the other norms'.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import SequenceParallel

from titan.config.job_config import JobConfig
from titan.models.llama.parallelize import apply_llama_cp, block_plan, parallelize_llama
from titan.models.moe.parallelize import apply_moe_family_tp, parallelize_moe_family
from titan.models.qwen3.model import Qwen3Block, Qwen3Transformer
from titan.parallel.dims import ParallelDims
from titan.parallel.tp import Plan


def qk_norm_plan() -> Plan:
    """Per-head q/k norms on the rank's local heads (a family with qwen3's attention reuses it)."""
    return {
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }


def _block_plan(block: Qwen3Block) -> Plan:
    return block_plan() | qk_norm_plan()


def apply_tp(
    model: Qwen3Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False
) -> None:
    """TP/SP for attention (q/k norms on the local heads), dense feed-forwards and the MoE blocks'
    router; the routed experts are the MoE driver's apply_experts' (ETP or TP). Qwen3 weights the
    experts' outputs by the router scores: the MoE plan sums the scores' gradient over TP."""
    apply_moe_family_tp(
        model, tp_mesh, _block_plan, "qwen3", loss_parallel=loss_parallel, enable_async_tp=enable_async_tp
    )


def parallelize_qwen3(model: Qwen3Transformer, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    if model.model_args.moe_enabled:
        return parallelize_moe_family(model, parallel_dims, job_config, apply_tp, "qwen3", cp_fn=apply_llama_cp)
    return parallelize_llama(model, parallel_dims, job_config, tp_fn=apply_tp)
