"""Qwen3 decoder (dense and MoE) on Llama 3's skeleton.

The embedding, final norm, output projection, RoPE table and forward tail are llama's Transformer.
Attention overrides two of llama's steps: ``project`` applies a per-head RMSNorm (over head_dim) to
queries and keys before RoPE, and ``position`` rotates with Qwen's (and Hugging Face's) half-split
pairing, feature j with feature j + head_dim / 2, instead of Meta's adjacent pairs: wq, wk and the
q/k norm weights then keep Hugging Face's (and torchtitan's qwen3) feature order, so checkpoints of
either load without a permutation. Blocks take titan's MoE layer where ``args.is_moe_layer``.
"""

from __future__ import annotations

import torch
from torch import nn

from titan.models.llama.flex import FlexKernel
from titan.models.llama.model import Attention, RMSNorm
from titan.models.max_logits import RowScale
from titan.models.moe.block import MoEBlock, MoETransformer
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

    qk_norm_offset = 0.0
    """What q_norm/k_norm add to their stored weight (a family whose norms scale by 1 + weight: 1)."""

    def qk_clip_scales(self, gamma: torch.Tensor) -> list[RowScale]:
        """QK-clip under per-head q/k RMSNorm: the logits no longer depend on wq/wk's scale, only on
        the norm weights, which every head of the layer shares. So the whole layer takes its
        smallest gamma (its largest logit): q_norm's and k_norm's weights each sqrt of it."""
        root = gamma.amin().sqrt().expand(self.head_dim)
        offset = self.qk_norm_offset
        return [RowScale(self.q_norm.weight, root, offset), RowScale(self.k_norm.weight, root, offset)]


class Qwen3Block(MoEBlock):
    attention: Qwen3Attention

    def __init__(self, layer_id: int, args: Qwen3ModelArgs, flex_kernel: FlexKernel | None = None) -> None:
        super().__init__(layer_id, args, Qwen3Attention(args, flex_kernel, layer_id), None, args.hidden_dim)

    def init_attention(self, out_std: float) -> None:
        super().init_attention(out_std)
        self.attention.q_norm.reset_parameters()  # per-head q/k norms start at one
        self.attention.k_norm.reset_parameters()


class Qwen3Transformer(MoETransformer):
    model_args: Qwen3ModelArgs

    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        model_args.validate()
        super().__init__(model_args)

    def make_block(self, layer_id: int, flex_kernel: FlexKernel | None) -> nn.Module:
        return Qwen3Block(layer_id, self.model_args, flex_kernel)
