"""The largest attention logit per head (titan/models/max_logits.py) against the scores written out
whole here: causal, document (dense, flex BlockMask and varlen boundaries) and chunked masks,
grouped-query heads, query rows cut into many chunks; and every attention kernel module keeping it
while training, accumulating over batches, leaving its output alone and ignoring evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import titan.models.max_logits as max_logits_mod
from titan.models.gpt_oss.attention import SinkAttention, dense_masks
from titan.models.llama.kernels import FlexAttention, SDPAttention, VarlenAttention
from titan.models.llama.masks import block_causal_dense, varlen_mask
from titan.models.llama4.model import chunked_causal_dense
from titan.models.max_logits import block_mask_rows, dense_rows, max_logits, varlen_rows

B, H, KVH, S, D = 2, 4, 2, 24, 8


def _qkv(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, D, generator=g) * 2 for h in (H, KVH, KVH))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _reference(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[H]: every score of every query head, masked by ``allowed`` [B or 1, 1, S, S], maximised."""
    scores = q.double() @ k.double().repeat_interleave(H // KVH, dim=1).transpose(-2, -1) * D**-0.5
    return scores.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3)).float()


def _doc_ids() -> torch.Tensor:
    docs = torch.zeros(B, S, dtype=torch.long)
    docs[0, 7:] = 1
    docs[0, 15:] = 2
    docs[1, 11:] = 1
    return docs


@pytest.mark.parametrize("chunk", [max_logits_mod.CHUNK_ELEMENTS, 3 * B * H * S])  # one chunk / 8 chunks of 3 rows
def test_max_logits_equal_the_masked_scores_maximum(monkeypatch, chunk) -> None:
    monkeypatch.setattr(max_logits_mod, "CHUNK_ELEMENTS", chunk)
    q, k, _ = _qkv()
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    docs = _doc_ids()
    block_causal = block_causal_dense(docs)
    torch.testing.assert_close(max_logits(q, k), _reference(q, k, causal))
    torch.testing.assert_close(max_logits(q, k, dense_rows(block_causal)), _reference(q, k, block_causal))
    chunked = chunked_causal_dense(S, 5, q.device, docs)
    torch.testing.assert_close(max_logits(q, k, dense_rows(chunked)), _reference(q, k, chunked))
    # no causal restriction: every key
    every = torch.ones(1, 1, S, S, dtype=torch.bool)
    torch.testing.assert_close(max_logits(q, k, causal=False), _reference(q, k, every))

    def same_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    flex_mask = create_block_mask(same_document, B, None, S, S, device="cpu")
    got = max_logits(q, k, block_mask_rows(flex_mask), causal=False)
    torch.testing.assert_close(got, _reference(q, k, block_causal))
    # flash varlen's document boundaries over the flattened batch (torch builds them on any device)
    cu = varlen_mask(docs).cu_seqlens
    torch.testing.assert_close(max_logits(q, k, varlen_rows(cu, B, S)), _reference(q, k, block_causal))


def test_bf16_max_is_the_bf16_rounding_of_the_fp32_one() -> None:
    q, k, _ = _qkv(dtype=torch.bfloat16)
    want = _reference(q, k, torch.ones(S, S, dtype=torch.bool).tril()[None, None])
    torch.testing.assert_close(max_logits(q, k), want, rtol=2**-7, atol=0)


def _kernels():
    docs = _doc_ids()
    block_causal = block_causal_dense(docs)
    flex_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, S, S, device="cpu")
    masks = dense_masks(S, None, torch.device("cpu"), docs)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(3))
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    return {  # kernel, its call's extra arguments, the allowed pairs
        "sdpa": (SDPAttention(), (), causal),
        "sdpa_block_causal": (SDPAttention(), (block_causal,), block_causal),
        "flex": (FlexAttention(), (flex_mask,), causal),
        "varlen_cpu": (VarlenAttention(), (block_causal,), block_causal),
        "sink": (SinkAttention(D**-0.5, None), (sinks, masks.full), masks.full[:, None]),
    }


@pytest.mark.parametrize("name", ["sdpa", "sdpa_block_causal", "flex", "varlen_cpu", "sink"])
def test_kernels_keep_the_maximum_while_training(name) -> None:
    kernel, extra, allowed = _kernels()[name]
    (q1, k1, v1), (q2, k2, v2) = _qkv(1), _qkv(2)
    untracked = kernel(q1, k1, v1, *extra)
    kernel.start_tracking(H, torch.device("cpu"))
    torch.testing.assert_close(kernel(q1, k1, v1, *extra), untracked, atol=0, rtol=0)
    torch.testing.assert_close(kernel.max_logits, _reference(q1, k1, allowed))
    kernel(q2, k2, v2, *extra)  # the step's maximum: over every batch of the step
    both = torch.maximum(_reference(q1, k1, allowed), _reference(q2, k2, allowed))
    torch.testing.assert_close(kernel.max_logits, both)
    kernel.eval()  # validation: not recorded
    kernel(q1 * 10, k1, v1, *extra)
    torch.testing.assert_close(kernel.max_logits, both)
    kernel.train()
    kernel.track_logits = False  # a step that neither clips nor logs
    kernel(q1 * 10, k1, v1, *extra)
    torch.testing.assert_close(kernel.max_logits, both)
    kernel.reset_max_logits()
    assert torch.isneginf(kernel.max_logits).all()


def test_activation_checkpointing_does_not_track_the_recompute(monkeypatch) -> None:
    from torch.utils.checkpoint import checkpoint

    import titan.models.llama.kernels as kernels_mod

    calls = []
    monkeypatch.setattr(kernels_mod, "max_logits", lambda *a, **kw: (calls.append(1), max_logits(*a, **kw))[1])
    kernel = SDPAttention()
    kernel.start_tracking(H, torch.device("cpu"))
    q, k, v = (t.requires_grad_() for t in _qkv())
    checkpoint(kernel, q, k, v, use_reentrant=False).sum().backward()
    assert len(calls) == 1  # the forward's; backward's recompute skips it
    torch.testing.assert_close(kernel.max_logits, max_logits(q.detach(), k.detach()))
