"""Parameter and FLOP counts of an MoE model (or pipeline stage): every expert is stored, but a token
runs only ``top_k`` of the ``num_experts`` routed experts, so training FLOPs count the ACTIVE
parameters. Each family adds its own attention term (the weightless q.k and score.v matmuls)."""

from __future__ import annotations

from typing import Any

from torch import nn


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters by kind: embedding, routed experts (all of them), the rest of the MoE layers
    (router, shared experts) and everything else (dense)."""
    counts = {"embedding": 0, "experts": 0, "moe_other": 0, "dense": 0}
    for name, p in model.named_parameters():
        if "tok_embeddings" in name:
            counts["embedding"] += p.numel()
        elif ".moe.experts." in name:
            counts["experts"] += p.numel()
        elif ".moe." in name:
            counts["moe_other"] += p.numel()
        else:
            counts["dense"] += p.numel()
    return counts


def active_matmul_params(model: nn.Module) -> int:
    """The parameters one token multiplies by: dense non-embedding + router + shared experts +
    routed experts * top_k / num_experts, and the embedding only when the output projection shares
    it (a lookup alone is a gather, not a matmul)."""
    args: Any = model.model_args
    c = parameter_counts(model)
    emb = getattr(model, "tok_embeddings", None)
    out = getattr(model, "output", None)
    tied = emb is not None and out is not None and out.weight is emb.weight
    active_experts = c["experts"] * args.moe_args.top_k // args.moe_args.num_experts
    return c["dense"] + c["moe_other"] + active_experts + (c["embedding"] if tied else 0)


def get_nparams_and_flops(model: nn.Module, seq_len: int) -> tuple[int, int]:
    """All parameters (every expert: what is stored) and training FLOPs per token on the active ones
    with llama's attention: 6 * active + 12 * L * H * Dh * T (attention scores over the whole
    window, as llama3's count and torchtitan's; a pipeline stage counts its own layers)."""
    args: Any = model.model_args
    attn = 12 * len(model.layers) * args.n_heads * args.head_dim * seq_len  # type: ignore[arg-type]
    return sum(p.numel() for p in model.parameters()), 6 * active_matmul_params(model) + attn


__all__ = ["active_matmul_params", "get_nparams_and_flops", "parameter_counts"]
