"""Auxiliary-loss-free load balancing (Wang et al. 2024, arXiv:2408.15664, as torchtitan applies it):
after each optimizer step every expert's routing bias moves ``load_balance_coeff`` towards balance."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from titan.models.moe.moe import MoE

ReduceFn = Callable[[torch.Tensor], torch.Tensor | None]
"""Sums a [moe layers, experts] count tensor over the ranks that saw different tokens (in place or
returned); None on one rank."""


def moe_layers(model_parts: Iterable[nn.Module]) -> list[tuple[str, MoE]]:
    """(FQN, layer) of every MoE layer in the parts, in module order (stable across ranks); the FQN
    without the names activation checkpointing and compile wrap modules in."""
    return [
        (name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""), m)
        for part in model_parts
        for name, m in part.named_modules()
        if isinstance(m, MoE)
    ]


def bias_delta(tokens_per_expert: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff * sign(mean load - load), re-centred to mean zero: overloaded experts go down, starved
    ones up, by the same step whatever the imbalance."""
    # sign(mean - load) as sign(sum - E * load): exact in the counts' integers.
    load = tokens_per_expert
    delta = coeff * torch.sign(load.sum() - load * load.numel()).float()
    return delta - delta.mean()


@torch.no_grad()
def update_expert_bias(model_parts: Iterable[nn.Module], reduce_fn: ReduceFn | None = None) -> None:
    """The optimizer-step hook: fold the step's token counts of every MoE layer (summed over ranks by
    ``reduce_fn``, in one call for all layers) into the log counters, move the biases of layers with
    a load_balance_coeff, and zero the step counts. No host read."""
    layers = [m for _, m in moe_layers(model_parts)]
    if not layers:
        return
    counts = torch.cat([m.tokens_per_expert for m in layers])
    if reduce_fn is not None:
        reduced = reduce_fn(counts)
        counts = counts if reduced is None else reduced
    for m, c in zip(layers, counts.split([m.tokens_per_expert.numel() for m in layers])):
        m.tokens_since_log.add_(c)
        if m.expert_bias is not None and m.load_balance_coeff is not None:
            m.expert_bias.add_(bias_delta(c, m.load_balance_coeff))
        m.tokens_per_expert.zero_()
