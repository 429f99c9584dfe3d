"""What the trainer does for models with MoE layers (titan.models.moe), family-agnostic.

- After every optimizer step: the step's token counts of every MoE layer, summed over the ranks
  that saw different data (dp x cp: one all-reduce for all layers), move the balancing biases
  and feed the log counters (``register_moe_balancing``). Every rank applies the same update, so
  the biases stay identical across data-parallel ranks.
- On log steps only: per layer the busiest expert's load over the mean load, the fraction of the
  grouped GEMM's rows that were padding and the number of experts that got no token since the
  last log step (``MoEMonitor``); a warning when a layer has had a starved expert for
  ``STARVED_LOG_STEPS`` log steps in a row. These tensors join the log step's one host read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from titan.log import logger
from titan.models.moe import moe_layers, update_expert_bias
from titan.parallel.dims import ParallelDims
from titan.training.metrics import FILES_ONLY_PREFIXES

STARVED_LOG_STEPS = 5
"""Consecutive log steps with an expert that got no token before a layer is warned about."""
PER_LAYER_PREFIX = FILES_ONLY_PREFIXES[0]
"""Per-layer scalars go to TensorBoard/W&B/JSONL, not to the console line."""


def count_reduction(dims: ParallelDims) -> Callable[[torch.Tensor], None] | None:
    """Sum over the dp x cp ranks (they route different tokens), or None on one such rank."""
    mesh = dims.submesh("dp_cp")
    if mesh is None:
        return None
    group = mesh.get_group()

    def reduce(counts: torch.Tensor) -> None:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)

    return reduce


def register_moe_balancing(optimizers, parts: list[nn.Module], dims: ParallelDims) -> None:
    """The expert-bias update as a hook after each optimizer step (nothing for dense models)."""
    if not moe_layers(parts):
        return
    reduce_fn = count_reduction(dims)
    optimizers.register_step_post_hook(lambda: update_expert_bias(parts, reduce_fn))


class MoEMonitor:
    """Per-layer routing statistics of the MoE layers in ``parts`` for the log steps."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.layers = moe_layers(parts)
        self.starved_for: dict[str, int] = {}

    def log_tensors(self) -> dict[str, torch.Tensor]:
        """Device scalars for this log step (and a fresh window for the next). Console: the worst
        layer's max/mean load and the padded fraction over all layers; per layer: files only."""
        if not self.layers:
            return {}
        out: dict[str, torch.Tensor] = {}
        ratios, padded, routed = [], [], []
        for name, m in self.layers:
            counts = m.tokens_since_log.float()
            ratio = counts.max() / counts.mean().clamp_min(1e-9)
            pad = m.padded_since_log.float()  # a copy: the buffer is zeroed below
            out[f"{PER_LAYER_PREFIX}{name}/tokens_max_over_mean"] = ratio
            out[f"{PER_LAYER_PREFIX}{name}/padded_fraction"] = pad / (pad + counts.sum()).clamp_min(1e-9)
            out[f"{PER_LAYER_PREFIX}{name}/starved_experts"] = (counts == 0).sum()
            ratios.append(ratio)
            padded.append(pad)
            routed.append(counts.sum())
            m.tokens_since_log.zero_()
            m.padded_since_log.zero_()
        out["moe_max_load"] = torch.stack(ratios).max()
        pad_all = torch.stack(padded).sum()
        out["moe_padded"] = pad_all / (pad_all + torch.stack(routed).sum()).clamp_min(1e-9)
        return out

    def check(self, step: int, values: dict[str, float]) -> None:
        """Warn about layers whose experts starve (values: the log step's read scalars)."""
        for name, _ in self.layers:
            starved = values.get(f"{PER_LAYER_PREFIX}{name}/starved_experts", 0.0)
            self.starved_for[name] = self.starved_for.get(name, 0) + 1 if starved > 0 else 0
            if self.starved_for[name] == STARVED_LOG_STEPS:
                logger.warning(
                    f"MoE layer {name}: {int(starved)} expert(s) got no token at step {step} and at each of the"
                    f" last {STARVED_LOG_STEPS} log steps (routing collapse? raise model.moe_load_balance_coeff"
                    " or set model.moe_aux_loss_coeff)"
                )
