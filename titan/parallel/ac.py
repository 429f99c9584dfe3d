"""Activation checkpointing per TransformerBlock: full, selective per op, or every N-th block.

Applied after TP/CP and before compile and FSDP (by each model's parallelize function), so compile sees the checkpointed
block and FSDP shards the wrapper. The wrapper adds "_checkpoint_wrapped_module." to parameter
names; DCP's state-dict helpers and titan.parallel.init.canonical_fqn strip it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan.config.choices import ACMode, choices
from titan.config.sections.activation_checkpoint import parse_selective_option
from titan.errors import TitanError
from titan.log import logger
from titan.parallel.utils import blocks_of

__all__ = ["AC_MODES", "apply_ac", "parse_selective_option", "MATMUL_OPS", "SAVED_OPS"]

AC_MODES = choices(ACMode)

aten = torch.ops.aten
# Matmuls: the expensive ops whose outputs are worth keeping. _scaled_mm is the float8 matmul.
MATMUL_OPS = frozenset({aten.mm.default, aten._scaled_mm.default})
# Always kept: attention (recomputing it costs as much as the forward) and TP reduce-scatters
# (recomputing would repeat the communication).
SAVED_OPS = frozenset(
    {
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        # expert parallel's token dispatch/combine: recomputing would repeat the all-to-all
        torch.ops._c10d_functional.all_to_all_single.default,
        # torchao computes float8 scales from abs().max(); keeping the amax avoids re-reducing.
        aten.max.default,
        # flex attention is a higher-order op of newer torch releases
        *([torch.ops.higher_order.flex_attention] if hasattr(torch.ops.higher_order, "flex_attention") else []),
    }
)


def _op_policy() -> Callable:
    """A fresh policy per checkpointed call: keeps every other matmul output, attention and the
    listed ops; recomputes the cheap pointwise work (norms, RoPE, SiLU) in backward.

    Counting separately in forward and in recompute gives both passes the same decisions.
    """
    counts: dict[bool, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMUL_OPS:
            counts[ctx.is_recompute] += 1
            # Save the 1st, 3rd, ... matmul: halves matmul recompute at half the memory.
            keep = counts[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context() -> tuple:
    return create_selective_checkpoint_contexts(_op_policy())


def _wrap(block: nn.Module, selective_op: bool) -> nn.Module:
    # preserve_rng_state=False: the blocks have no dropout, and saving RNG state costs a sync on CUDA.
    if selective_op:
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_op_context)
    return checkpoint_wrapper(block, preserve_rng_state=False)


def apply_ac(model: nn.Module, mode: str, selective_ac_option: int | str = "op") -> list[str]:
    """Wrap blocks of ``model.layers`` in place; returns the names of the wrapped blocks.

    Blocks keep their layer-id names, so with pipeline stages "every N-th" stays a property of
    the layer, not of its position inside a stage. The mode is checked again here (the config
    loader did it for the trainer) because any other string would silently mean full AC.
    """
    if mode not in AC_MODES:
        raise TitanError(f"config key 'activation_checkpoint.mode' got {mode!r}; valid: {', '.join(AC_MODES)}")
    if mode == "none":
        return []
    option = parse_selective_option(selective_ac_option) if mode == "selective" else None
    wrapped = []
    blocks = blocks_of(model)
    for name, block in list(blocks.named_children()):
        if isinstance(option, int) and int(name) % option != 0:
            continue
        blocks.register_module(name, _wrap(block, selective_op=option == "op"))
        wrapped.append(name)
    what = {None: "full", "op": "selective per op"}.get(option, f"full on every {option}-th block")
    logger.info(f"applied activation checkpointing ({what}) to {len(wrapped)} of {len(blocks)} blocks")
    return wrapped
