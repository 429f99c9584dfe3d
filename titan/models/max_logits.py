"""The largest pre-softmax attention logit of each head, tracked during the forward (pure torch).

QK-clip (titan/training/qk_clip.py) and its metric need, per head, the largest q . k * scale the
softmax saw in a step, over the unmasked pairs. The attention kernel modules (``LogitKernel``:
llama's SDPA, flex and varlen kernels, gpt-oss's sink kernel; every family that reuses them) keep it
in a device buffer while ``track_logits`` is on and the module is training; nothing is read on the
host. Where the kernel has it, it comes from the kernel: flex_attention's ``max_scores`` on CUDA,
the scores gpt-oss's sink attention materialises anyway. SDPA and flash varlen return no logits, so
``max_logits`` computes them without gradient, query rows in chunks (``CHUNK_ELEMENTS`` scores at a
time) and only the keys a causal row can see: one more q . k^T per layer, about half the FLOPs of
the kernel's forward (a seventh of its forward and backward), in the activations' dtype (bf16
activations round the max to bf16), plus writing and reading those scores once.

Activation checkpointing's recompute does not track again (eager: it would only repeat the same
maximum; compiled graphs leave the unused computation out).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "CHUNK_ELEMENTS",
    "CHUNK_ROWS",
    "LogitKernel",
    "RowScale",
    "block_mask_rows",
    "dense_rows",
    "max_logits",
    "varlen_rows",
]

CHUNK_ELEMENTS = 1 << 26
"""Scores per block of query rows x keys (x2 bytes in bf16; a masked block holds a masked copy too)."""
CHUNK_ROWS = 256
"""Query rows per chunk at most: with a causal mask a chunk computes its diagonal block in full, so
smaller chunks skip more of the masked half (256 rows of 8,192: 52% of the square computed)."""

MaskRows = Callable[[int, int, int, int], torch.Tensor]
"""(first row, end row, first key, end key) -> bool [B or 1, 1, rows, keys]: which of those keys
those query rows may see."""


def dense_rows(mask: torch.Tensor) -> MaskRows:
    """Blocks of a dense bool mask [B or 1, 1, S, Sk] (titan's block-causal and chunked masks)."""
    return lambda r0, r1, k0, k1: mask[..., r0:r1, k0:k1]


def block_mask_rows(block_mask) -> MaskRows:
    """Blocks of a flex BlockMask, from its mask_mod (evaluated densely, a block at a time)."""

    def rows(r0: int, r1: int, k0: int, k1: int) -> torch.Tensor:
        device = block_mask.kv_indices.device
        b = torch.arange(block_mask.kv_indices.shape[0], device=device).view(-1, 1, 1)
        q_idx = torch.arange(r0, r1, device=device).view(1, -1, 1)
        kv_idx = torch.arange(k0, k1, device=device).view(1, 1, -1)
        allowed = block_mask.mask_mod(b, torch.zeros_like(b), q_idx, kv_idx)
        return allowed.expand(b.shape[0], r1 - r0, k1 - k0).unsqueeze(1)

    return rows


def varlen_rows(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> MaskRows:
    """Blocks of the flash varlen mask: same document (boundaries ``cu_seqlens`` over the flattened
    [B * S] tokens); max_logits adds the causal part."""
    flat = torch.arange(batch * seqlen, device=cu_seqlens.device)
    docs = (torch.searchsorted(cu_seqlens, flat, right=True) - 1).view(batch, seqlen)
    return lambda r0, r1, k0, k1: (docs[:, r0:r1, None] == docs[:, None, k0:k1]).unsqueeze(1)


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
    training); ``mask_rows`` narrows that further; ``scale`` defaults to Dh ** -0.5 (SDPA's).

    Query rows go in chunks; with ``causal`` each chunk takes the keys before its first row (all
    visible: no mask, no masked copy unless ``mask_rows``) and its diagonal block, never the keys
    after its last row."""
    b, h, s, d = q.shape
    kv_heads, sk = k.shape[1], k.shape[2]
    softmax_scale = d**-0.5 if scale is None else scale
    rep = h // kv_heads
    qg = q.reshape(b, kv_heads, rep, s, d)
    kt = k.transpose(-2, -1)  # [B, KVH, Dh, Sk]
    rows = max(1, min(CHUNK_ROWS, CHUNK_ELEMENTS // (b * h * sk)))
    best = torch.full((kv_heads, rep), -math.inf, device=q.device)
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        # The chunk's query rows of all heads that share a key head, as one matrix: a plain batched
        # matmul per key head (broadcasting the keys over the group would copy them per head).
        q_rows = qg[..., r0:r1, :].reshape(b, kv_heads, rep * (r1 - r0), d)
        blocks = [(0, min(r0, sk), False), (r0, min(r1, sk), True)] if causal else [(0, sk, False)]
        for k0, k1, diagonal in blocks:
            if k1 <= k0:
                continue
            scores = torch.matmul(q_rows, kt[..., k0:k1]).view(b, kv_heads, rep, r1 - r0, k1 - k0)
            allowed = None if mask_rows is None else mask_rows(r0, r1, k0, k1)
            if diagonal:  # key j of the block is visible to row i when k0 + j <= r0 + i
                tri = torch.ones(r1 - r0, k1 - k0, dtype=torch.bool, device=q.device).tril()[None, None]
                allowed = tri if allowed is None else allowed & tri
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
