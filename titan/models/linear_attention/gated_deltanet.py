"""Gated DeltaNet (Yang et al., 2024), the linear-attention token mixer of Qwen3.5 and Qwen3-Next.

Per token: q, k, v, an output gate z, a decay input a and a write strength b are projected from the
block input; q, k and v pass a short depthwise causal convolution (+ SiLU); the recurrent state
[Dk, Dv] of every value head decays by exp(g), g = -exp(A_log) * softplus(a + dt_bias), and takes
the delta rule's correction of v with strength sigmoid(b); each head's read-out is RMS-normalised,
gated by SiLU(z) and projected back. No positions: the state carries the order.

Heads: HK query/key heads each serve HV / HK consecutive value heads. Tensor parallelism splits both
head counts like attention heads (the q/k/v/z/a/b projections column-wise, their convolution
channels and A_log / dt_bias with them, the output projection row-wise); the norm's weight is
shared by all heads. Parameters may be DTensors there: the forward works on their local shards.

Packed documents: the ``attn_mask`` argument is a DocumentSpans (or None for one sequence per row);
the recurrent state and the convolution restart at every document. Generation keeps the
convolution's last inputs and the state in the KV cache's per-layer state slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.kv_cache import KVCache
from titan.models.linear_attention import delta_rule, kernels


@dataclass(frozen=True)
class DocumentSpans:
    """The packed documents of a batch, for linear-attention layers: ``doc_ids`` [B, S]
    (titan.models.documents) and, for fla's kernels on CUDA, ``cu_seqlens`` [N + 1] over the
    flattened batch (every row starts a document)."""

    doc_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None = None


def _local(w: torch.Tensor) -> torch.Tensor:
    """A parameter sharded by tensor parallelism (a DTensor) as this rank's shard: its heads."""
    to_local = getattr(w, "to_local", None)
    return cast(torch.Tensor, to_local()) if callable(to_local) else w


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's value features, weight applied after the cast back (transformers'
    Qwen3.5 gated norm before its gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class CausalConv(nn.Module):
    """The depthwise convolution's weight [channels, width]; GatedDeltaNet runs it."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width))

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[-1])  # nn.Conv1d's default: fan-in of one group
        nn.init.uniform_(self.weight, -bound, bound)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        dim: int,
        n_key_heads: int,
        n_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_width: int = 4,
        norm_eps: float = 1e-6,
        backend: str = "auto",
        layer_id: int = 0,
    ) -> None:
        super().__init__()
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.backend = backend
        self.layer_id = layer_id  # its slot in a generation cache
        key, value = n_key_heads * key_head_dim, n_value_heads * value_head_dim
        self.in_proj_q = nn.Linear(dim, key, bias=False)
        self.in_proj_k = nn.Linear(dim, key, bias=False)
        self.in_proj_v = nn.Linear(dim, value, bias=False)
        self.in_proj_z = nn.Linear(dim, value, bias=False)
        self.in_proj_a = nn.Linear(dim, n_value_heads, bias=False)
        self.in_proj_b = nn.Linear(dim, n_value_heads, bias=False)
        self.conv_q, self.conv_k = CausalConv(key, conv_width), CausalConv(key, conv_width)
        self.conv_v = CausalConv(value, conv_width)
        self.A_log = nn.Parameter(torch.empty(n_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_value_heads))
        self.norm = HeadRMSNorm(value_head_dim, norm_eps)
        self.out_proj = nn.Linear(value, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor | None = None,
        attn_mask: DocumentSpans | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x [B, S, dim] -> [B, S, dim]; ``freqs_cis`` is unused (a block calls every token mixer alike)."""
        b, s, _ = x.shape
        qkv = torch.cat([self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x)], dim=-1)
        z, a, beta_in = self.in_proj_z(x), self.in_proj_a(x), self.in_proj_b(x)
        weights = [_local(c.weight) for c in (self.conv_q, self.conv_k, self.conv_v)]
        # One convolution over the q, k and v channels (transformers' layout: one conv1d over all three).
        weight = torch.cat(weights, dim=0)
        cached = kv_cache.state(self.layer_id) if kv_cache is not None else None
        fla = kernels.uses_fla(self.backend, x) and kv_cache is None
        cu = attn_mask.cu_seqlens if attn_mask is not None else None
        if fla:
            qkv_conv = kernels.fla_conv(qkv, weight, cu)
        else:
            docs = attn_mask.doc_ids if attn_mask is not None else None
            qkv_conv = delta_rule.causal_conv1d(qkv, weight, doc_ids=docs, state=cached[0] if cached else None)
        q, k, v = qkv_conv.split([w.shape[0] for w in weights], dim=-1)
        q = q.reshape(b, s, -1, self.key_head_dim)
        k = k.reshape(b, s, -1, self.key_head_dim)
        v = v.reshape(b, s, -1, self.value_head_dim)
        beta = beta_in.sigmoid()
        # In fp32: a half-precision exp(A_log) can overflow.
        g = -_local(self.A_log).float().exp() * F.softplus(a.float() + _local(self.dt_bias))
        if fla:
            out = kernels.fla_delta_rule(q, k, v, g, beta, cu)
        else:
            docs = attn_mask.doc_ids if attn_mask is not None else None
            out, state = delta_rule.chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                doc_ids=docs,
                initial_state=cached[1] if cached else None,
                output_final_state=kv_cache is not None,
            )
            if kv_cache is not None:
                kv_cache.set_state(self.layer_id, (self._conv_state(qkv, cached, weight.shape[-1]), state))
        gate = z.reshape(b, s, -1, self.value_head_dim)
        out = (self.norm(out) * F.silu(gate.float())).to(out.dtype)
        return self.out_proj(out.reshape(b, s, -1))

    @staticmethod
    def _conv_state(qkv: torch.Tensor, cached: Any, width: int) -> torch.Tensor:
        """The convolution's last width - 1 inputs [B, C, W - 1] after this chunk (zeros before the prompt)."""
        xt = qkv.transpose(1, 2)
        before = cached[0] if cached else xt.new_zeros(*xt.shape[:2], width - 1)
        return torch.cat([before.to(xt.dtype), xt], dim=-1)[..., -(width - 1) :].detach()

    def init_weights(self, out_std: float) -> None:
        """Projections in at 0.02 and out at ``out_std`` (the block's depth-scaled std), the
        convolution as torch's Conv1d, A = exp(A_log) uniform in [0.01, 16] (away from zero, so
        its log is finite), dt_bias one and the norm at one (transformers' init)."""
        for lin in (self.in_proj_q, self.in_proj_k, self.in_proj_v, self.in_proj_z, self.in_proj_a, self.in_proj_b):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.out_proj.weight, mean=0.0, std=out_std)
        for conv in (self.conv_q, self.conv_k, self.conv_v):
            conv.reset_parameters()
        with torch.no_grad():
            self.A_log.uniform_(0.01, 16.0).log_()
        nn.init.ones_(self.dt_bias)
        self.norm.reset_parameters()
