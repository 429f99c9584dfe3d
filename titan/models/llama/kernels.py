"""The attention kernel modules: SDPA, flex_attention and flash varlen, each a parameter-free module
called as kernel(q, k, v, mask) on [B, H, S, Dh] queries and [B, KVH, S, Dh] keys/values.

Modules rather than functions so context parallelism can hook their inputs and outputs
(titan/parallel/cp.py), and so each keeps its heads' largest logit while QK-clip or its metric asks
for it (titan.models.max_logits.LogitKernel): inside the kernel call is where context parallelism
has gathered every key a query sees. A family picks one with ``attention_kernel(attn_type, ...)``.
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask

from titan.models.llama.flex import FlexKernel
from titan.models.llama.masks import VarlenMask
from titan.models.max_logits import LogitKernel, block_mask_rows, dense_rows, max_logits, varlen_rows
from titan.models.sdpa import sdpa

__all__ = ["FlexAttention", "SDPAttention", "VarlenAttention", "attention_kernel"]


class SDPAttention(LogitKernel):
    """Causal SDPA: with a boolean ``attn_mask`` (block-causal or chunked, causal too) that mask
    replaces the plain causal one. k/v keep their own (fewer) heads: titan.models.sdpa reads them
    in place. SDPA returns no logits: tracking computes them (titan.models.max_logits)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.tracking():
            self.record(max_logits(q, k, None if attn_mask is None else dense_rows(attn_mask)))
        if attn_mask is None:
            return sdpa(q, k, v, is_causal=True)
        return sdpa(q, k, v, attn_mask=attn_mask)


class FlexAttention(LogitKernel):
    """flex_attention (context parallelism gathers k/v in a hook). ``kernel`` is the model's shared
    FlexKernel (one compiled flex_attention per model). Tracking on CUDA takes the kernel's own
    per-row maximum (``max_scores``, free); flex on other devices has none, so the mask_mod is
    evaluated row chunk by row chunk."""

    def __init__(self, kernel: FlexKernel | None = None) -> None:
        super().__init__()
        self.kernel = kernel if kernel is not None else FlexKernel()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        if not self.tracking():
            return self.kernel(q, k, v, block_mask)
        if q.device.type != "cuda":
            self.record(max_logits(q, k, block_mask_rows(block_mask), causal=False))
            return self.kernel(q, k, v, block_mask)
        out, aux = self.kernel(q, k, v, block_mask, return_aux=AuxRequest(max_scores=True))
        self.record(aux.max_scores.amax(dim=(0, 2)))  # [B, H, S] -> [H]
        return out


def _varlen_takes_gqa() -> bool:
    """Whether this torch's varlen_attn reads grouped k/v heads itself (its enable_gqa argument)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


class VarlenAttention(LogitKernel):
    """Per-document causal attention: torch's flash varlen kernel on CUDA; on CPU (mask given as the
    dense boolean mask) SDPA with that mask. The kernel returns no logits: tracking computes them
    from the document boundaries."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: VarlenMask | torch.Tensor
    ) -> torch.Tensor:
        b, h, s, d = q.shape
        if not isinstance(attn_mask, VarlenMask):
            if self.tracking():
                self.record(max_logits(q, k, dense_rows(attn_mask)))
            return sdpa(q, k, v, attn_mask=attn_mask)
        from torch.nn.attention.varlen import varlen_attn

        if self.tracking():
            self.record(max_logits(q, k, varlen_rows(attn_mask.cu_seqlens, b, s)))
        gqa = k.shape[1] != h
        if gqa and not _varlen_takes_gqa():
            # A torch without grouped-query varlen: k/v repeated to the query heads (a copy).
            k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
            gqa = False
        q, k, v = (t.transpose(1, 2).reshape(b * s, -1, d) for t in (q, k, v))
        cu, n = attn_mask.cu_seqlens, attn_mask.max_len
        if gqa:  # (-1, 0): causal
            out = varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0), enable_gqa=True)
        else:
            out = varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0))
        assert isinstance(out, torch.Tensor)  # no return_aux: the output alone
        return out.view(b, s, h, d).transpose(1, 2)


def attention_kernel(attn_type: str, flex_kernel: FlexKernel | None = None) -> LogitKernel:
    """The kernel module of ``model.attn_type`` (flex ones share the model's ``flex_kernel``)."""
    if attn_type == "flex":
        return FlexAttention(flex_kernel)
    return VarlenAttention() if attn_type == "varlen" else SDPAttention()
