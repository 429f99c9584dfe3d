"""torch.compile per TransformerBlock (after TP/CP/AC, before FSDP) and of the loss.

Per-block compilation keeps compile time bounded (all blocks share one graph, so it is compiled
once) and lets FSDP2's hooks run between blocks, outside the graphs. Blocks are compiled in
place (``nn.Module.compile``) so parameter names, and with them checkpoints, do not change.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from titan.log import logger
from titan.parallel.utils import blocks_of

__all__ = ["apply_compile", "build_loss_fn", "is_compiled"]


def is_compiled(module: nn.Module) -> bool:
    """True once ``module.compile()`` has replaced its call with a compiled one."""
    return getattr(module, "_compiled_call_impl", None) is not None


def wait_async_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    # A TP embedding's output can be an AsyncCollectiveTensor (from to_local() before the
    # collective finished). Handed straight to a compiled block, its backward fails with
    # "'Tensor' object has no attribute '_local_tensor'" (torch 2.13, pytorch/pytorch#180614); waiting here first
    # costs nothing that the next op would not wait for anyway. Not with .wait(): it returns the
    # tensor under the wrapper, outside autograd, and the embedding would get no gradient. A copy
    # (any non-view op) waits and keeps the autograd edge.
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(output, AsyncCollectiveTensor):
        return output.clone()
    return output


def apply_compile(model: nn.Module, *, before_blocks: nn.Module | None = None, fullgraph: bool = True) -> int:
    """Compile each block of ``model.layers`` in place; returns how many were compiled.
    ``before_blocks`` is the module whose output the first block takes (e.g. a TP embedding):
    its async output is waited for."""
    blocks = blocks_of(model)
    for block in blocks.values():
        block.compile(fullgraph=fullgraph)
    if before_blocks is not None:
        before_blocks.register_forward_hook(wait_async_output)
    logger.info(f"compiled {len(blocks)} blocks (fullgraph={fullgraph})")
    return len(blocks)


def build_loss_fn(loss_fn: Callable, compile_loss: bool) -> Callable:
    """The loss as given, or compiled: the float32 upcast, log-softmax and gather of a
    [tokens, vocab] logits matrix fuse into far fewer passes over memory."""
    if not compile_loss:
        return loss_fn
    logger.info("compiled the loss function")
    return torch.compile(loss_fn)
