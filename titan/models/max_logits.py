"""The largest pre-softmax attention logit of each head, tracked during the forward (pure torch).

QK-clip (titan/training/qk_clip.py) and its metric need, per head, the largest q . k * scale the
softmax saw in a step, over the unmasked pairs. The attention kernel modules (``LogitKernel``:
llama's SDPA, flex and varlen kernels, gpt-oss's sink kernel; every family that reuses them) keep it
in a device buffer while ``track_logits`` is on and the module is training; nothing is read on the
host. Where the kernel has it, it comes from the kernel: flex_attention's ``max_scores`` on CUDA,
the scores gpt-oss's sink attention materialises anyway. SDPA and flash varlen return no logits, so
``max_logits`` computes them without gradient, query rows in chunks (``CHUNK_ELEMENTS`` scores at a
time) and only the keys a causal row can see: one more q . k^T per layer, about half the FLOPs of
the kernel's forward, in the activations' dtype (bf16 activations round the max to bf16).

Activation checkpointing's recompute does not track again (eager: it would only repeat the same
maximum; compiled graphs leave the unused computation out).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CHUNK_ELEMENTS", "LogitKernel", "RowScale", "block_mask_rows", "dense_rows", "max_logits", "varlen_rows"]

CHUNK_ELEMENTS = 1 << 26
"""Scores per chunk of query rows (x2 bytes in bf16: the chunk's products and their masked copy)."""

MaskRows = Callable[[int, int, int], torch.Tensor]
"""(first row, end row, keys) -> bool [B or 1, 1, rows, keys]: which keys those query rows may see."""


def dense_rows(mask: torch.Tensor) -> MaskRows:
    """Rows of a dense bool mask [B or 1, 1, S, Sk] (titan's block-causal and chunked masks)."""
    return lambda r0, r1, keys: mask[..., r0:r1, :keys]


def block_mask_rows(block_mask) -> MaskRows:
    """Rows of a flex BlockMask, from its mask_mod (evaluated densely, a chunk of rows at a time)."""

    def rows(r0: int, r1: int, keys: int) -> torch.Tensor:
        device = block_mask.kv_indices.device
        b = torch.arange(block_mask.kv_indices.shape[0], device=device).view(-1, 1, 1)
        q_idx = torch.arange(r0, r1, device=device).view(1, -1, 1)
        kv_idx = torch.arange(keys, device=device).view(1, 1, -1)
        allowed = block_mask.mask_mod(b, torch.zeros_like(b), q_idx, kv_idx)
        return allowed.expand(b.shape[0], r1 - r0, keys).unsqueeze(1)

    return rows


def varlen_rows(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> MaskRows:
    """Rows of the flash varlen mask: same document (boundaries ``cu_seqlens`` over the flattened
    [B * S] tokens) and causal."""
    flat = torch.arange(batch * seqlen, device=cu_seqlens.device)
    docs = (torch.searchsorted(cu_seqlens, flat, right=True) - 1).view(batch, seqlen)
    return lambda r0, r1, keys: (docs[:, r0:r1, None] == docs[:, None, :keys]).unsqueeze(1)


@torch.no_grad()
def max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    mask_rows: MaskRows | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """[H] float32: per query head the largest ``q . k * scale`` over the allowed pairs (``-inf``
    where a head saw none). q [B, H, S, Dh], k [B, KVH, Sk, Dh] (query head h reads key head
    h // (H / KVH)); ``causal``: query row i sees keys 0 .. i (rows and keys aligned, as in
    training); ``mask_rows`` narrows that further; ``scale`` defaults to Dh ** -0.5 (SDPA's)."""
    b, h, s, d = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    softmax_scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, kv_heads, h // kv_heads, s, d)
    kt = k.unsqueeze(2).transpose(-2, -1)  # [B, KVH, 1, Dh, Sk]
    rows = max(1, CHUNK_ELEMENTS // (b * h * sk))
    best = torch.full((kv_heads, h // kv_heads), -math.inf, device=q.device)
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        keys = min(sk, r1) if causal else sk
        scores = torch.matmul(qg[..., r0:r1, :], kt[..., :keys])  # [B, KVH, rep, rows, keys]
        allowed = None if mask_rows is None else mask_rows(r0, r1, keys)
        if causal:
            pos = (torch.arange(r0, r1, device=q.device)[:, None] >= torch.arange(keys, device=q.device))[None, None]
            allowed = pos if allowed is None else allowed & pos
        if allowed is not None:
            scores = scores.masked_fill(~allowed.unsqueeze(2), -math.inf)
        best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).float())
    # The scale is positive: the largest scaled product is the scaled largest one.
    return best.flatten() * softmax_scale


def _recomputing() -> bool:
    """Inside backward: eager activation checkpointing runs the forward again there, with nothing
    new to record. (Compiled graphs decide their recompute themselves and leave unused work out.)"""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class LogitKernel(nn.Module):
    """An attention kernel module (parameter-free; context parallelism hooks its q/k/v) that can
    keep the largest logit of each of its heads since the last ``reset_max_logits``.

    ``start_tracking(heads, device)`` makes the ``max_logits`` buffer (``heads``: this rank's, after
    tensor parallelism); then, while ``track_logits`` is on and the module is training (not under
    validation's eval), a subclass's forward hands each batch's per-head maximum to ``record``."""

    max_logits: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.track_logits = False

    def start_tracking(self, heads: int, device: torch.device) -> None:
        self.register_buffer("max_logits", torch.full((heads,), -math.inf, device=device), persistent=False)
        self.track_logits = True

    def tracking(self) -> bool:
        return self.track_logits and self.training and not _recomputing()

    def record(self, batch_max: torch.Tensor) -> None:
        self.max_logits.copy_(torch.maximum(self.max_logits, batch_max.detach().float()))

    def reset_max_logits(self) -> None:
        self.max_logits.fill_(-math.inf)


@dataclass(frozen=True)
class RowScale:
    """Part of a QK-clip rescale: ``param`` (a weight, bias or norm weight, plain or sharded) becomes
    ``(param + offset) * scale - offset``, ``scale`` [param.shape[0]] per row of the whole
    parameter (``offset``: a norm whose weight is stored as weight - 1)."""

    param: torch.Tensor
    scale: torch.Tensor
    offset: float = 0.0
