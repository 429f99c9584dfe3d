"""Llama 4 decoder (torchtitan's llama4 family and Meta's released models) on Llama 3's skeleton.

The embedding, final norm, output projection, RoPE table and the forward tail are llama3's
Transformer; the blocks differ: MoE blocks (``Llama4ModelArgs.is_moe_layer``) have an MoE
feed-forward (titan.models.moe) instead of the dense one; with iRoPE, NoPE blocks have no
positional embedding and full causal attention while chunked blocks attend only within fixed
blocks of ``fixed_attn_block_size`` positions. Meta's released models also L2-normalise q and k
on RoPE blocks and scale q on NoPE blocks by a position-dependent temperature (Llama4Attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

from titan.errors import TitanError
from titan.models.kv_cache import KVCache
from titan.models.llama.flex import FlexKernel
from titan.models.llama.model import Attention, ffn_hidden_dim
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.max_logits import RowScale
from titan.models.moe.block import MoEBlock, MoETransformer


@dataclass(frozen=True)
class IRopeMasks:
    """The two masks of a model with chunked blocks: ``rope`` for the chunked blocks (the RoPE
    blocks of torchtitan's iRoPE), attending within fixed blocks; ``nope`` for the others, over
    the whole causal (or block-causal) window. None: sdpa's plain causal attention."""

    rope: Any
    nope: Any


def chunked_causal_dense(seqlen: int, block: int, device: torch.device, doc_ids: torch.Tensor | None) -> torch.Tensor:
    """[B or 1, 1, S, S] bool: query i sees key j <= i in the same block of ``block`` positions
    (and the same document when ``doc_ids`` [B, S] is given)."""
    pos = torch.arange(seqlen, device=device)
    mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] // block == pos[None, :] // block)
    if doc_ids is None:
        return mask[None, None]
    return (mask[None] & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation over the head dimension, in fp32 (Meta's "L2 norm" of q/k)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(Attention):
    """Llama 3's attention plus Meta's two released changes, both in the position step:
    RoPE blocks normalise q and k after RoPE (``use_qk_norm``); NoPE blocks multiply q by a
    temperature that grows with the log of the position (``attn_temperature_tuning``), so
    full-context attention stays sharp far beyond the chunk length."""

    def __init__(self, args: Llama4ModelArgs, flex_kernel: FlexKernel | None, layer_id: int) -> None:
        super().__init__(args, flex_kernel, layer_id, use_rope=args.uses_rope(layer_id))
        self.qk_norm_eps = args.norm_eps if args.use_qk_norm and self.use_rope else None
        self.temperature = (
            (args.floor_scale, args.attn_scale) if args.attn_temperature_tuning and not self.use_rope else None
        )

    def position(
        self, xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        xq, xk = super().position(xq, xk, freqs_cis, start)
        if self.qk_norm_eps is not None:
            xq, xk = l2_norm(xq, self.qk_norm_eps), l2_norm(xk, self.qk_norm_eps)
        if self.temperature is not None:
            # xq holds the whole sequence here (TP/SP gather it first; llama4 refuses CP), so
            # its positions are start .. start + S.
            floor_scale, attn_scale = self.temperature
            pos = torch.arange(start, start + xq.shape[1], device=xq.device, dtype=torch.float32)
            scale = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            xq = (xq * scale.view(1, -1, 1, 1)).to(xq.dtype)
        return xq, xk

    def qk_clip_scales(self, gamma: torch.Tensor) -> list[RowScale]:
        """QK-clip: llama's rescale, except on blocks whose q and k are normalised without a weight
        (``use_qk_norm``): no parameter scales their logits, which stay below sqrt(head_dim)."""
        return [] if self.qk_norm_eps is not None else super().qk_clip_scales(gamma)


class Llama4Block(MoEBlock):
    def __init__(self, layer_id: int, args: Llama4ModelArgs, flex_kernel: FlexKernel | None = None) -> None:
        attention = Llama4Attention(args, flex_kernel, layer_id)
        super().__init__(layer_id, args, attention, args.moe_hidden_dim, ffn_hidden_dim(args))
        self.chunked = args.is_chunked(layer_id)

    def block_mask(self, attn_mask: Any) -> Any:
        if isinstance(attn_mask, IRopeMasks):
            return attn_mask.rope if self.chunked else attn_mask.nope
        return attn_mask


class Llama4Transformer(MoETransformer):
    model_args: Llama4ModelArgs

    def __init__(self, model_args: Llama4ModelArgs) -> None:
        model_args.validate()
        super().__init__(model_args)
        self._create_block_mask: Any = None

    def make_block(self, layer_id: int, flex_kernel: FlexKernel | None) -> nn.Module:
        return Llama4Block(layer_id, self.model_args, flex_kernel)

    def attention_mask(
        self, seqlen: int, device: torch.device, doc_ids: torch.Tensor | None, kv_cache: KVCache | None
    ) -> Any:
        nope = super().attention_mask(seqlen, device, doc_ids, kv_cache)
        args = self.model_args
        if not args.any_chunked:
            return nope
        block = args.fixed_attn_block_size
        if kv_cache is not None:
            # The cache attends causally over everything cached: right only within one block.
            if kv_cache.pos + seqlen > block:
                raise TitanError(
                    f"generation with an iRoPE llama4 model is limited to model.fixed_attn_block_size ({block})"
                    f" positions; asked for {kv_cache.pos + seqlen}"
                )
            return None
        return IRopeMasks(self._chunked_mask(seqlen, block, device, doc_ids), nope)

    def _chunked_mask(self, seqlen: int, block: int, device: torch.device, doc_ids: torch.Tensor | None) -> Any:
        if self.model_args.attn_type != "flex":
            return chunked_causal_dense(seqlen, block, device, doc_ids)

        def chunked(b, h, q_idx, kv_idx):  # signature fixed by flex_attention
            ok = (q_idx >= kv_idx) & (q_idx // block == kv_idx // block)
            return ok if doc_ids is None else ok & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

        create = create_block_mask
        if device.type == "cuda":  # compiled, it builds block by block instead of the whole S x S
            if self._create_block_mask is None:
                self._create_block_mask = torch.compile(create_block_mask)
            create = self._create_block_mask
        batch = None if doc_ids is None else doc_ids.shape[0]
        return create(chunked, batch, None, seqlen, seqlen, device=device)
