"""titan.models.sdpa on the GPU: grouped-query attention through a fused kernel (cuDNN or Flash, never
math), the same numbers as attention over k/v repeated to the query heads, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from titan.models.sdpa import sdpa

pytestmark = pytest.mark.cuda

B, H, KVH, S, D = 2, 32, 8, 1024, 128  # the Llama 3 8B head layout


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (
        torch.randn(B, KVH, S, D, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        for _ in range(2)
    )
    return q, k, v


def test_gqa_causal_runs_a_fused_kernel_without_copies():
    q, k, v = _inputs()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = sdpa(q, k, v, is_causal=True)
        out.sum().backward()
    names = {e.name for e in prof.events()}
    fused = {"aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention"}
    assert names & fused, sorted(n for n in names if "attention" in n)
    assert "aten::_scaled_dot_product_attention_math" not in names
    assert "aten::repeat_interleave" not in names


def test_gqa_matches_attention_over_repeated_heads():
    q, k, v = _inputs()
    out = sdpa(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    rq, rk, rv = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(
        rq, rk.repeat_interleave(H // KVH, 1), rv.repeat_interleave(H // KVH, 1), is_causal=True
    )
    ref_grads = torch.autograd.grad(ref.square().sum(), (rq, rk, rv))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), want, atol=5e-2 * want.abs().max().item(), rtol=5e-2)


def test_deterministic_mode_leaves_cudnn_out():
    q, k, v = _inputs()
    torch.use_deterministic_algorithms(True)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sdpa(q, k, v, is_causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_cudnn_attention" not in names
    assert "aten::_scaled_dot_product_flash_attention" in names
