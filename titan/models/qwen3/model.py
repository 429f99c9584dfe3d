"""Qwen3 decoder (dense and MoE) on Llama 3's skeleton.

The embedding, final norm, output projection, RoPE table and forward tail are llama's Transformer.
Attention overrides two of llama's steps: ``project`` applies a per-head RMSNorm (over head_dim) to
queries and keys before RoPE, and ``position`` rotates with Qwen's (and Hugging Face's) half-split
pairing, feature j with feature j + head_dim / 2, instead of Meta's adjacent pairs: wq, wk and the
q/k norm weights then keep Hugging Face's (and torchtitan's qwen3) feature order, so checkpoints of
either load without a permutation. Blocks take titan's MoE layer where ``args.is_moe_layer``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from titan.models.kv_cache import KVCache
from titan.models.llama.flex import FlexKernel
from titan.models.llama.model import Attention, FeedForward, RMSNorm, Transformer
from titan.models.moe import MoE
from titan.models.qwen3.args import Qwen3ModelArgs


def apply_rotary_emb_half(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q/k [B, S, H, Dh] by position, feature j paired with j + Dh/2 (``rotate_half``),
    with the same complex table [S, Dh/2] llama's interleaved rotation uses."""
    cos = freqs_cis.real.view(1, freqs_cis.shape[0], 1, -1)
    sin = freqs_cis.imag.view(1, freqs_cis.shape[0], 1, -1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)

    return rotate(xq), rotate(xk)


class Qwen3Attention(Attention):
    def __init__(self, args: Qwen3ModelArgs, flex_kernel: FlexKernel | None = None, layer_id: int = 0) -> None:
        super().__init__(args, flex_kernel, layer_id)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Per head: under TP these see the rank's local heads (the norm weight is shared by all heads).
        xq, xk, xv = super().project(x)
        return self.q_norm(xq), self.k_norm(xk), xv

    def position(
        self, xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_emb_half(xq, xk, freqs_cis)


class Qwen3Block(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3ModelArgs, flex_kernel: FlexKernel | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_layers = args.n_layers
        self.depth_init = args.depth_init
        self.attention = Qwen3Attention(args, flex_kernel, layer_id)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args.moe_args, args.dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_mask: Any = None, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, attn_mask=attn_mask, kv_cache=kv_cache)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        # As llama's blocks (depth-scaled output projections); q/k norms start at one.
        depth = self.layer_id + 1 if self.depth_init else self.n_layers
        out_std = 0.02 / math.sqrt(2 * depth)
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.attention.wo.weight, mean=0.0, std=out_std)
        if self.moe_enabled:
            self.moe.init_weights(out_std, buffer_device)
        else:
            nn.init.trunc_normal_(self.feed_forward.w1.weight, mean=0.0, std=0.02)
            for lin in (self.feed_forward.w2, self.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=out_std)
        for norm in (self.attention_norm, self.ffn_norm, self.attention.q_norm, self.attention.k_norm):
            norm.reset_parameters()


class Qwen3Transformer(Transformer):
    model_args: Qwen3ModelArgs

    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        model_args.validate()
        super().__init__(model_args)

    def make_block(self, layer_id: int, flex_kernel: FlexKernel | None) -> nn.Module:
        return Qwen3Block(layer_id, self.model_args, flex_kernel)

    def _blocks(self) -> list[Qwen3Block]:
        return [m for m in self.layers.modules() if isinstance(m, Qwen3Block)]  # also inside AC wrappers

    def init_buffers(self, device: torch.device | None = None) -> None:
        super().init_buffers(device)
        for block in self._blocks():
            if block.moe_enabled:
                block.moe.reset_counters(self.freqs_cis.device)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device)  # embedding, final norm, output, RoPE table
        for block in self._blocks():
            block.init_weights(self.freqs_cis.device)
