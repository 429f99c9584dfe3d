"""The MoE feed-forward layer: router -> sort tokens by expert -> grouped experts -> unsort, plus
an optional shared expert, auxiliary-loss-free balancing state and a sequence-wise balance loss."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import cast

import torch
from torch import nn

from titan.models.llama.model import FeedForward
from titan.models.moe.args import MoEArgs
from titan.models.moe.experts import GroupedExperts
from titan.models.moe.router import TokenChoiceTopKRouter

# The factor the backward pass applies to every MoE layer's balance loss (set by the trainer so the
# loss is normalised like the token loss: see aux_loss_scale). None: the mean over the batch's sequences.
_AUX_SCALE: list[torch.Tensor | float | None] = [None]


@contextlib.contextmanager
def aux_loss_scale(scale: torch.Tensor | float) -> Iterator[None]:
    """Within this block a balance loss reaches the backward pass as ``scale * sum over sequences
    of (seq_len * loss of the sequence)``. The trainer passes the token loss's own factor
    (data-parallel degree / global token count): with every sequence weighted by its tokens the
    balance loss is then the global batch's mean, whatever the data-parallel layout and accumulation."""
    _AUX_SCALE[0] = scale
    try:
        yield
    finally:
        _AUX_SCALE[0] = None


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in the backward pass ``aux`` gets gradient ``scale`` as if ``scale * aux``
    had been added to the loss, without the loss function ever seeing it."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(scale)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        (scale,) = ctx.saved_tensors
        return grad, scale.reshape(()), None


def sequence_balance_loss(
    scores: torch.Tensor,
    experts: torch.Tensor,
    bs: int,
    num_experts: int,
    seq_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    seq_shards: int = 1,
) -> torch.Tensor:
    """Sum over sequences of seq_len * sum_i f_i P_i (DeepSeek-V3's sequence-wise balance loss):
    f_i = E / (k T) * tokens of the sequence routed to expert i (no gradient), P_i = the mean over
    the sequence of expert i's score normalised over the experts.

    Under context parallelism each rank holds 1/``seq_shards`` of every sequence and ``seq_sum``
    sums a [bs, E] tensor over those ranks: f is then the whole sequence's, and as the loss is
    linear in P (seq_len * P_i = the sum of the scores over the tokens) the ranks' values and
    gradients add up to the whole sequence's."""
    n, k = experts.shape
    slen = n // bs
    probs = scores / scores.sum(dim=-1, keepdim=True)
    p_sum = probs.view(bs, slen, num_experts).sum(dim=1)
    hits = torch.zeros(bs, num_experts, device=scores.device, dtype=scores.dtype)
    hits.scatter_add_(1, experts.view(bs, slen * k), torch.ones(bs, slen * k, device=scores.device, dtype=scores.dtype))
    if seq_sum is not None:
        hits = seq_sum(hits)
    f = hits * (num_experts / (k * slen * seq_shards))
    return (f * p_sum).sum()


def _count_outside_recompute(buffer: torch.Tensor, counts: torch.Tensor) -> None:
    """Add this forward's counts, except while activation checkpointing recomputes the forward in
    the backward pass (it would count every token twice). Kept out of compiled graphs: the check
    is a Python side condition."""
    if torch._C._current_graph_task_id() == -1:
        buffer.add_(counts)


@functools.cache
def _count_fn() -> Callable[[torch.Tensor, torch.Tensor], None]:
    # torch.compiler.disable imports torch._dynamo (about 1 s of CPU): paid by the first MoE
    # forward, not by every process that imports titan.
    return cast(Callable[[torch.Tensor, torch.Tensor], None], torch.compiler.disable(_count_outside_recompute))


def _count(buffer: torch.Tensor, counts: torch.Tensor) -> None:
    _count_fn()(buffer, counts)


class MoE(nn.Module):
    tokens_per_expert: torch.Tensor
    tokens_since_log: torch.Tensor
    padded_since_log: torch.Tensor

    def __init__(self, args: MoEArgs, dim: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden = hidden_dim if hidden_dim is not None else args.hidden_dim
        if hidden is None:
            raise ValueError("MoE needs the experts' hidden_dim (argument or MoEArgs.hidden_dim)")
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.router = TokenChoiceTopKRouter(
            dim,
            args.num_experts,
            args.top_k,
            args.score_func,
            args.route_norm,
            args.route_scale,
            args.gate_bias,
            args.force_load_balance,
            args.num_expert_groups,
            args.num_limited_groups,
        )
        self.experts = GroupedExperts(
            dim, hidden, args.num_experts, args.use_grouped_mm, args.experts_bias, args.swiglu_limit, args.swiglu_alpha
        )
        shared = args.shared_hidden_dim if args.shared_hidden_dim is not None else hidden * args.num_shared_experts
        self.shared_experts = FeedForward(dim, shared) if args.num_shared_experts else None
        # Qwen3-Next / Qwen3.5: the shared experts' output scaled by a per-token sigmoid gate.
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_expert_gate else None
        self.score_before_experts = args.score_before_experts
        self.load_balance_coeff = args.load_balance_coeff
        self.aux_loss_coeff = args.aux_loss_coeff
        # Context parallelism splits each sequence over seq_shards ranks; seq_sum (set by the
        # parallelize step) sums the balance loss's per-sequence counts over them.
        self.seq_shards = 1
        self.seq_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.expert_bias: torch.Tensor | None
        if args.load_balance_coeff is not None:
            # Checkpointed: the routing the model has learned to expect.
            self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        else:
            self.expert_bias = None
        # The step's routed token counts (summed over micro-batches; update_expert_bias reads and
        # zeroes them after the step) and, for the logs, the counts and grouped-GEMM padding rows
        # since the last log step; training-mode forwards only. Not checkpointed: they are zero at
        # every step boundary but the log's.
        # Integers (int64), like the router's counts: a float32 sum is exact only up to 2^24 tokens.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("tokens_since_log", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("padded_since_log", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim]."""
        bs, slen, dim = x.shape
        flat = x.reshape(-1, dim)
        top, experts, counts, scores = self.router(flat, self.expert_bias)
        if self.training:  # validation's tokens must not move the biases of the next training step
            with torch.no_grad():
                _count(self.tokens_per_expert, counts)
        # A stable sort keeps each expert's tokens in token order (deterministic sums).
        order = torch.argsort(experts.view(-1), stable=True)
        routed = flat[order // self.top_k]
        if self.score_before_experts:
            routed = (routed.float() * top.view(-1)[order].unsqueeze(-1)).to(x.dtype)
        if self.experts.uses_grouped_mm(routed):
            align = self.experts.group_align(routed)
            if align > 1 and self.training:
                with torch.no_grad():
                    _count(self.padded_since_log, ((counts + align - 1) // align * align - counts).sum())
        out_sorted = self.experts(routed, counts)
        out = self.shared_experts(flat) if self.shared_experts is not None else None
        if out is not None and self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(flat)) * out
        unsorted = out_sorted.new_zeros(out_sorted.shape).index_copy(0, order, out_sorted).view(-1, self.top_k, dim)
        if self.score_before_experts:
            routed_out = unsorted.sum(dim=1)
        else:
            routed_out = (unsorted.float() * top.unsqueeze(-1)).sum(dim=1).to(x.dtype)
        out = routed_out if out is None else out + routed_out
        out = out.view(bs, slen, dim)
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux = self.aux_loss_coeff * sequence_balance_loss(
                scores, experts, bs, self.num_experts, self.seq_sum, self.seq_shards
            )
            scale = _AUX_SCALE[0]
            if scale is None:  # the mean over whole sequences (slen is this rank's part under CP)
                scale = 1.0 / (bs * slen * self.seq_shards)
            out = _AddAuxLossGrad.apply(out, aux, torch.as_tensor(scale, dtype=aux.dtype, device=aux.device))
        return out

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        """Parameters as torchtitan's llama4 (router and output projections at ``init_std``, the
        experts' input projection at 0.02) and the balancing state back to zero."""
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            nn.init.trunc_normal_(self.shared_experts.w1.weight, mean=0.0, std=0.02)
            nn.init.trunc_normal_(self.shared_experts.w2.weight, mean=0.0, std=init_std)
            nn.init.trunc_normal_(self.shared_experts.w3.weight, mean=0.0, std=init_std)
        if self.shared_gate is not None:
            nn.init.trunc_normal_(self.shared_gate.weight, mean=0.0, std=init_std)
        self.reset_counters(buffer_device)
        if self.expert_bias is not None:
            self.expert_bias = torch.zeros(self.num_experts, device=self.tokens_per_expert.device)

    def reset_counters(self, device: torch.device | None = None) -> None:
        """Zero the token and padding counters (on ``device``, default where they are): after a
        meta-device build and to_empty() they hold garbage, and no checkpoint restores them."""
        device = device if device is not None else self.tokens_per_expert.device
        self.tokens_per_expert = torch.zeros(self.num_experts, device=device, dtype=torch.int64)
        self.tokens_since_log = torch.zeros(self.num_experts, device=device, dtype=torch.int64)
        self.padded_since_log = torch.zeros((), device=device, dtype=torch.int64)
