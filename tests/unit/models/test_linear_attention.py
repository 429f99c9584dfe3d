"""The Gated DeltaNet's exact torch path: transformers' chunked delta rule and causal convolution
bit for bit on one sequence per row; packed documents (ids from titan.models.documents) give each
document what it gets alone, for the rule, the convolution and the whole module (fp32, within
rounding); a generation cache continues a sequence as one pass does; the backend choice."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_chunk_gated_delta_rule

from titan.errors import TitanError
from titan.models.kv_cache import KVCache
from titan.models.linear_attention import (
    DocumentSpans,
    GatedDeltaNet,
    causal_conv1d,
    check_backend,
    chunk_gated_delta_rule,
    resolve_backend,
)

B, S, HK, HV, DK, DV = 2, 150, 2, 4, 8, 6  # 150: three chunks of 64, the last one padded
G = torch.Generator().manual_seed(0)
Q, K = torch.randn(B, S, HK, DK, generator=G), torch.randn(B, S, HK, DK, generator=G)
V = torch.randn(B, S, HV, DV, generator=G)
DECAY, BETA = -torch.rand(B, S, HV, generator=G), torch.rand(B, S, HV, generator=G)
X, W = torch.randn(B, S, 10, generator=G), torch.randn(10, 4, generator=G)
# Row 0: documents of 30, 70 and 50 tokens; row 1: a boundary at a chunk's start (64) and a
# one-token document right after it.
DOCS = torch.zeros(B, S, dtype=torch.int32)
DOCS[0, 30:], DOCS[0, 100:], DOCS[1, 64:], DOCS[1, 65:] = 1, 2, 1, 2


def _spans() -> list[tuple[int, slice]]:
    out = []
    for b in range(B):
        for d in DOCS[b].unique():
            idx = (DOCS[b] == d).nonzero().flatten()
            out.append((b, slice(int(idx[0]), int(idx[-1]) + 1)))
    return out


def test_one_sequence_per_row_is_transformers_bit_for_bit() -> None:
    ref, _ = torch_chunk_gated_delta_rule(Q, K, V, DECAY, BETA, use_qk_l2norm_in_kernel=True)
    out, _ = chunk_gated_delta_rule(Q, K, V, DECAY, BETA)
    assert torch.equal(out, ref)
    conv_ref = causal_conv1d_fn(X.transpose(1, 2), W, None, activation="silu").transpose(1, 2)
    assert torch.equal(causal_conv1d(X, W), conv_ref)


def test_packed_documents_restart_state_and_convolution() -> None:
    out, _ = chunk_gated_delta_rule(Q, K, V, DECAY, BETA, doc_ids=DOCS)
    conv = causal_conv1d(X, W, doc_ids=DOCS)
    for b, sl in _spans():
        alone, _ = chunk_gated_delta_rule(*(t[b : b + 1, sl] for t in (Q, K, V, DECAY, BETA)))
        torch.testing.assert_close(out[b : b + 1, sl], alone, atol=2e-6, rtol=0)
        torch.testing.assert_close(conv[b : b + 1, sl], causal_conv1d(X[b : b + 1, sl], W), atol=2e-6, rtol=0)
    # One document per row: the masks change nothing.
    same, _ = chunk_gated_delta_rule(Q, K, V, DECAY, BETA, doc_ids=torch.zeros_like(DOCS))
    assert torch.equal(same, chunk_gated_delta_rule(Q, K, V, DECAY, BETA)[0])


def _module() -> GatedDeltaNet:
    torch.manual_seed(0)
    gdn = GatedDeltaNet(32, HK, HV, DK, DV, backend="torch")
    gdn.init_weights(0.02)
    return gdn


def test_module_packed_documents_forward_and_backward_as_each_alone() -> None:
    gdn = _module()
    x = torch.randn(B, S, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    packed = gdn(x, attn_mask=DocumentSpans(DOCS))
    packed.square().sum().backward()
    grad, x.grad = x.grad, None
    for b, sl in _spans():
        part = x[b : b + 1, sl].detach().requires_grad_()
        alone = gdn(part)
        torch.testing.assert_close(packed[b : b + 1, sl], alone, atol=2e-6, rtol=0)
        alone.square().sum().backward()
        assert grad is not None and part.grad is not None
        torch.testing.assert_close(grad[b : b + 1, sl], part.grad, atol=1e-5, rtol=0)


def test_generation_cache_continues_the_sequence() -> None:
    gdn = _module()
    x = torch.randn(1, 70, 32, generator=torch.Generator().manual_seed(2))
    cache = KVCache(128)
    with torch.no_grad():
        whole = gdn(x)
        steps = [gdn(x[:, :66], kv_cache=cache)] + [gdn(x[:, i : i + 1], kv_cache=cache) for i in range(66, 70)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=0)


def test_backend_choice() -> None:
    assert resolve_backend("auto", "cpu")[0] == "torch" and resolve_backend("torch", "cuda")[0] == "torch"
    check_backend("auto", "cpu")
    with pytest.raises(TitanError, match="model.linear_attn_backend' got 'fla', which needs CUDA") as e:
        check_backend("fla", "cpu")
    assert "\n" not in str(e.value)
