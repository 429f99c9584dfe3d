"""Token-choice top-k routing: each token picks its k best-scoring experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TokenChoiceTopKRouter(nn.Module):
    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: str = "sigmoid",
        route_norm: bool = False,
        route_scale: float = 1.0,
        gate_bias: bool = False,
        force_load_balance: bool = False,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.force_load_balance = force_load_balance
        self.num_expert_groups, self.num_limited_groups = num_expert_groups, num_limited_groups

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """[N, E] router scores in fp32 (sigmoid or softmax of the gate's logits)."""
        logits = self.gate(x).float()
        return torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (top_scores [N, k] fp32, experts [N, k] int64, tokens per expert [E] int64,
        all scores [N, E] fp32). ``expert_bias`` shifts only which experts are chosen; the weights
        the chosen experts get are the unbiased scores."""
        scores = self.scores(x)
        if self.force_load_balance:
            n = scores.shape[0]
            experts = torch.arange(n * self.top_k, device=scores.device).view(n, self.top_k) % self.num_experts
        else:
            choice = scores if expert_bias is None else scores + expert_bias
            if self.num_expert_groups is not None:
                choice = self.limit_groups(choice)
            experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        top = scores.gather(1, experts)
        if self.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        top = top * self.route_scale
        # scatter_add, not bincount/histc: bincount reads its max on the host, histc has no int path on CPU.
        # Integer counts: a mixed-precision policy casts floating-point inputs of the experts' forward
        # (bf16 holds whole numbers exactly only up to 256), never integer ones.
        counts = torch.zeros(self.num_experts, device=x.device, dtype=torch.int64)
        counts.scatter_add_(0, experts.reshape(-1), torch.ones(experts.numel(), device=x.device, dtype=torch.int64))
        return top, experts, counts, scores

    def limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` [N, E] with the experts outside each token's ``num_limited_groups`` best groups
        (a group's score: the sum of its two best) set to -inf, so top-k never picks them."""
        assert self.num_expert_groups is not None and self.num_limited_groups is not None
        grouped = choice.view(choice.shape[0], self.num_expert_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.topk(group_scores, self.num_limited_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)
