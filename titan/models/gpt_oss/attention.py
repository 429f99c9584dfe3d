"""gpt-oss attention: learned per-head sinks, sliding windows, two kernels with the same numbers.

A sink is one more logit per head in every query's softmax, with no value: softmax over
[scores, sink] then the sink's column dropped, so a query may put probability mass nowhere.

- ``sink_attention`` (every device): the scores, the sink column, the mask (causal, document and
  sliding window), softmax in fp32, the sink column dropped. torch's SDPA kernels take no sinks, so
  this is the path on CPU and with ``attn_type = "sdpa"``; it materialises the [S, S] scores.
- ``flex_sink_attention`` (``attn_type = "flex"``, CUDA): flex_attention with its log-sum-exp, then
  out * sigmoid(lse - sink). Exact: with Z = sum_j exp(s_j), softmax([s, sink])_j =
  exp(s_j) / (Z + e^sink) = (exp(s_j) / Z) * sigmoid(ln Z - sink).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from titan.models.max_logits import LogitKernel


@dataclass(frozen=True)
class GptOssMasks:
    """What the blocks get: the full-attention mask and the sliding-window one. Dense bool masks
    [B or 1, S, S] for sink_attention, or BlockMasks for the flex path."""

    full: Any
    sliding: Any


def dense_masks(seqlen: int, window: int | None, device: torch.device, doc_ids: torch.Tensor | None) -> GptOssMasks:
    """Causal (and same-document with ``doc_ids`` [B, S]) masks; the sliding one also keeps
    q - k < window."""
    pos = torch.arange(seqlen, device=device)
    full = (pos[:, None] >= pos[None, :])[None]
    if doc_ids is not None:
        full = full & (doc_ids[:, :, None] == doc_ids[:, None, :])
    sliding = full if window is None else full & ((pos[:, None] - pos[None, :]) < window)[None]
    return GptOssMasks(full, sliding)


def block_masks(
    seqlen: int, window: int | None, device: torch.device, doc_ids: torch.Tensor | None, create: Any = None
) -> GptOssMasks:
    """The same two masks as flex BlockMasks (``create``: a compiled create_block_mask on CUDA)."""
    create = create or create_block_mask

    def full(b, h, q_idx, kv_idx):  # signature fixed by flex_attention
        ok = q_idx >= kv_idx
        return ok if doc_ids is None else ok & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    def sliding(b, h, q_idx, kv_idx):
        return full(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    batch = None if doc_ids is None else doc_ids.shape[0]
    full_mask = create(full, batch, None, seqlen, seqlen, device=device)
    sliding_mask = full_mask if window is None else create(sliding, batch, None, seqlen, seqlen, device=device)
    return GptOssMasks(full_mask, sliding_mask)


def sink_scores_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """sink_attention's output and its masked fp32 logits [B, KVH, H / KVH, S, Sk] (masked: -inf)."""
    bs, n_heads, seqlen, head_dim = q.shape
    kv_heads = k.shape[1]
    rep = n_heads // kv_heads
    qg = q.reshape(bs, kv_heads, rep, seqlen, head_dim)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-2, -1)).float() * scale  # [B, KVH, rep, S, Sk]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    sink = sinks.float().view(1, kv_heads, rep, 1, 1).expand(bs, kv_heads, rep, seqlen, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs.to(v.dtype), v.unsqueeze(2))
    return out.reshape(bs, n_heads, seqlen, head_dim), scores


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, S, Dh], k/v [B, KVH, Sk, Dh], sinks [H], mask bool [B or 1, S, Sk] -> [B, H, S, Dh].
    Query head h reads kv head h // (H / KVH), in place (no copy of k/v per query head)."""
    return sink_scores_attention(q, k, v, sinks, mask, scale)[0]


def flex_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    kernel: Any = None,
    max_scores: bool = False,
) -> Any:
    """sink_attention's numbers from flex_attention's output and log-sum-exp (``kernel``: a
    compiled flex_attention; eager flex materialises the scores, as sink_attention does). With
    ``max_scores``: (output, the largest logit of each query row [B, H, S])."""
    kernel = kernel or flex_attention
    request = AuxRequest(lse=True, max_scores=max_scores)
    gqa = q.shape[1] != k.shape[1]
    out, aux = kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=request)
    weight = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1)).unsqueeze(-1)
    out = (out.float() * weight).to(q.dtype)
    return (out, aux.max_scores) if max_scores else out


class SinkAttention(LogitKernel):
    """The kernel module of gpt-oss's attention (sinks, masks): flex on CUDA with a flex kernel,
    sink_attention otherwise. Tracking (titan.models.max_logits) takes the largest logit from the
    scores sink_attention materialises, or from flex's per-row maximum: free either way."""

    def __init__(self, scale: float, flex: FlexSinkKernel | None) -> None:
        super().__init__()
        self.scale = scale
        self.flex = flex

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, mask: Any) -> Any:
        track = self.tracking()
        if self.flex is not None and q.device.type == "cuda":
            if not track:
                return flex_sink_attention(q, k, v, sinks, mask, self.scale, self.flex)
            out, row_max = flex_sink_attention(q, k, v, sinks, mask, self.scale, self.flex, max_scores=True)
            self.record(row_max.amax(dim=(0, 2)))
            return out
        if not track:
            return sink_attention(q, k, v, sinks, mask, self.scale)
        out, scores = sink_scores_attention(q, k, v, sinks, mask, self.scale)
        self.record(scores.detach().amax(dim=(0, 3, 4)).flatten())
        return out


class FlexSinkKernel:
    """flex_attention with its log-sum-exp, compiled once per model on CUDA (eager elsewhere, and
    inside compiled blocks, whose graph lowers it)."""

    def __init__(self) -> None:
        self._compiled: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        q = args[0]
        if q.device.type != "cuda" or torch.compiler.is_compiling():
            return flex_attention(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(flex_attention, dynamic=False)
        return self._compiled(*args, **kwargs)
