"""Tensor + sequence parallelism: apply a model's parallelize_module plan, and async TP.

The plans themselves (which submodule is colwise, rowwise, sequence parallel) belong to each
model family's parallelize function; this file only applies them. A plan that
turns on sequence parallelism between blocks makes every norm weight a DTensor (Replicate) like
the other parameters: plain tensors next to DTensors break grad clipping and foreach optimizers
(seen on CPU/gloo with torch 2.13).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titan.errors import TitanError

Plan = dict[str, ParallelStyle]


def check_tp_shapes(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Colwise q/k/v split whole heads across TP ranks: both head counts must divide."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if value % tp:
            raise TitanError(
                f"parallelism.tensor_parallel_degree {tp} must divide model {name} ({value});"
                " pick a degree that divides both head counts"
            )


def apply_tp_plan(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    root_plan: Plan,
    blocks: Iterable[nn.Module],
    block_plan: Plan,
    *,
    enable_async_tp: bool = False,
) -> None:
    """Shard `model` over `tp_mesh`: `root_plan` on the model itself (FQNs relative to it), then
    `block_plan` on each of `blocks` (the repeated layers, so one plan serves any depth and any
    pipeline stage's subset)."""
    if enable_async_tp:
        enable_async_tensor_parallel(tp_mesh)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan)


class _GradSum(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over ``group`` (a functional collective, which
    compile traces: a DTensor to_local with Partial grad placements lost the sum in compiled blocks)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: str) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None


class SumGradOverTP(ParallelStyle):
    """A module's output every TP rank computes whole but uses only for its own shard (a key shared
    by all heads, expanded to the local heads; router scores weighting partial expert outputs): the
    same forward, and in the backward pass the ranks' partial gradients summed (an all-reduce).
    ``output_index``: which element of a tuple output (None: the output itself)."""

    def __init__(self, output_index: int | None = None) -> None:
        super().__init__()
        self.output_index = output_index

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group().group_name

        def summed(t: torch.Tensor) -> torch.Tensor:
            return _GradSum.apply(t, group)

        def hook(mod: nn.Module, inputs: Any, output: Any) -> Any:
            if self.output_index is None:
                return summed(output)
            out = list(output)
            out[self.output_index] = summed(out[self.output_index])
            return tuple(out)

        module.register_forward_hook(hook)
        return module


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Async TP overlaps the TP collectives with matmuls via symmetric memory (CUDA only); the
    fused kernels come from compile's micro-pipeline pass, so blocks must also be compiled."""
    if tp_mesh.device_type != "cuda":
        # Only the dry run gets here: it stands in for GPUs on a CPU (a fake process group), and
        # titan.parallel.dims.check_layout refused async TP on any other device before the mesh existed.
        return
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True


class ShardParameters(ParallelStyle):
    """A module's own parameters (``names``; None: all it holds directly) split on dim 0 over the
    mesh: per-head or per-channel parameters that follow a column-wise projection's heads (a
    convolution's channels, per-head decays). The module reads its local shards itself."""

    def __init__(self, names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        for name, param in list(module.named_parameters(recurse=False)):
            if self.names is None or name in self.names:
                sharded = nn.Parameter(distribute_tensor(param.data, device_mesh, [Shard(0)]), param.requires_grad)
                module.register_parameter(name, sharded)
        return module
