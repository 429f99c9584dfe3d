"""Qwen3.5 / Qwen3-Next decoder: llama's skeleton with blocks whose token mixer is, per layer, the
Gated DeltaNet (titan.models.linear_attention) or qwen3's attention with an output gate and partial
RoPE; norms scale by (1 + weight). Blocks are titan's MoE blocks (dense SwiGLU or MoE with a gated
shared expert), each keeping its mixer as ``attention`` so the shared plans (activation
checkpointing, compile, FSDP, pipeline split) treat both kinds alike.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from titan.models.kv_cache import KVCache
from titan.models.linear_attention import DocumentSpans, GatedDeltaNet
from titan.models.llama.flex import FlexKernel
from titan.models.llama.masks import varlen_mask
from titan.models.llama.model import RMSNorm, precompute_freqs_cis
from titan.models.moe.block import MoEBlock, MoETransformer
from titan.models.qwen3.model import Qwen3Attention, apply_rotary_emb_half
from titan.models.qwen3_5.args import Qwen35ModelArgs


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + weight), the weight starting at zero; computed in fp32 and cast back
    after the scale (transformers' Qwen3.5 / Qwen3-Next RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


@dataclass(frozen=True)
class HybridMask:
    """What every block gets: the attention layers' mask and the linear-attention layers' documents."""

    attention: Any
    documents: DocumentSpans | None


class Qwen35Attention(Qwen3Attention):
    """qwen3's attention whose query projection also yields, per head, a gate: the output is
    multiplied by sigmoid(gate) before ``wo``. wq's rows are [q (head_dim), gate (head_dim)] per
    head (Hugging Face's order), so tensor parallelism splits whole heads with their gates."""

    qk_norm_offset = 1.0  # QK-clip scales the norms' 1 + weight (qwen3's rescale of q_norm / k_norm)

    def __init__(self, args: Qwen35ModelArgs, flex_kernel: FlexKernel | None, layer_id: int) -> None:
        super().__init__(args, flex_kernel, layer_id)
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim * 2, bias=False)
        self.q_norm = OffsetRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = OffsetRMSNorm(args.head_dim, eps=args.norm_eps)
        self.rotary_dim = args.rotary_dim

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, attn_mask: Any = None, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q_gate = self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim)
        xq, gate = q_gate.chunk(2, dim=-1)
        xq = self.q_norm(xq)
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        start = kv_cache.pos if kv_cache is not None else 0
        xq, xk = self.position(xq, xk, freqs_cis[start : start + seqlen], start)
        if kv_cache is not None:
            out = self._cached_attention(xq, xk, xv, kv_cache)
        else:
            q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))
            out = self.attend(q, k, v, attn_mask)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1) * torch.sigmoid(gate.reshape(bs, seqlen, -1))
        return self.wo(out)

    def position(
        self, xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-split RoPE on the first rotary_dim features of each head; the rest pass."""
        r = self.rotary_dim
        q_rot, k_rot = apply_rotary_emb_half(xq[..., :r], xk[..., :r], freqs_cis)
        return torch.cat([q_rot, xq[..., r:]], dim=-1), torch.cat([k_rot, xk[..., r:]], dim=-1)


class Qwen35Block(MoEBlock):
    attention: Any

    def __init__(self, layer_id: int, args: Qwen35ModelArgs, flex_kernel: FlexKernel | None = None) -> None:
        layer_type = args.layer_type(layer_id)
        if layer_type == "full_attention":
            mixer: Any = Qwen35Attention(args, flex_kernel, layer_id)
        else:
            mixer = GatedDeltaNet(
                args.dim,
                args.linear_num_key_heads,
                args.linear_num_value_heads,
                args.linear_key_head_dim,
                args.linear_value_head_dim,
                args.linear_conv_kernel_dim,
                args.norm_eps,
                args.linear_attn_backend,
                layer_id,
            )
        super().__init__(layer_id, args, mixer, None, args.hidden_dim)
        self.layer_type = layer_type
        self.attention_norm = OffsetRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = OffsetRMSNorm(args.dim, eps=args.norm_eps)

    def block_mask(self, attn_mask: Any) -> Any:
        if not isinstance(attn_mask, HybridMask):
            return attn_mask
        return attn_mask.attention if self.layer_type == "full_attention" else attn_mask.documents

    def init_attention(self, out_std: float) -> None:
        if isinstance(self.attention, GatedDeltaNet):
            self.attention.init_weights(out_std)
            return
        super().init_attention(out_std)
        self.attention.q_norm.reset_parameters()
        self.attention.k_norm.reset_parameters()


class Qwen35Transformer(MoETransformer):
    model_args: Qwen35ModelArgs
    norm_cls = OffsetRMSNorm
    compile_fullgraph: bool = True
    """False where the parallelize step chose fla's kernels, which run outside torch.compile."""

    def __init__(self, model_args: Qwen35ModelArgs) -> None:
        model_args.validate()
        super().__init__(model_args)
        self.norm = OffsetRMSNorm(model_args.dim, eps=model_args.norm_eps)

    def make_block(self, layer_id: int, flex_kernel: FlexKernel | None) -> nn.Module:
        return Qwen35Block(layer_id, self.model_args, flex_kernel)

    def rope_table(self, device: torch.device | str | None) -> torch.Tensor:
        # Only the first rotary_dim features of a head rotate: the table's frequencies are theirs.
        return precompute_freqs_cis(replace(self.model_args, head_dim=self.model_args.rotary_dim), device=device)

    def attention_mask(
        self, seqlen: int, device: torch.device, doc_ids: torch.Tensor | None, kv_cache: KVCache | None
    ) -> Any:
        attention = super().attention_mask(seqlen, device, doc_ids, kv_cache)
        if kv_cache is not None or self.document_masks is None or doc_ids is None:
            return HybridMask(attention, None)
        # fla's kernels take the documents as boundaries over the flattened batch (built on CUDA only).
        cu = varlen_mask(doc_ids).cu_seqlens.long() if doc_ids.device.type == "cuda" else None
        return HybridMask(attention, DocumentSpans(doc_ids, cu))
