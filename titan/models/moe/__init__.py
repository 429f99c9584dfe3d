"""Mixture-of-experts layer for any model family: MoEArgs, MoE (router, grouped experts, shared
expert), auxiliary-loss-free balancing (update_expert_bias, an optimizer-step hook) and a
sequence-wise balance loss that reaches the backward pass without the loss function."""

from titan.models.moe.args import MoEArgs
from titan.models.moe.balance import bias_delta, moe_layers, update_expert_bias
from titan.models.moe.experts import GroupedExperts, grouped_mm_supported, run_grouped, run_loop
from titan.models.moe.moe import MoE, aux_loss_scale, sequence_balance_loss
from titan.models.moe.router import TokenChoiceTopKRouter

__all__ = [
    "MoE",
    "MoEArgs",
    "GroupedExperts",
    "TokenChoiceTopKRouter",
    "aux_loss_scale",
    "bias_delta",
    "grouped_mm_supported",
    "moe_layers",
    "run_grouped",
    "run_loop",
    "sequence_balance_loss",
    "update_expert_bias",
]
