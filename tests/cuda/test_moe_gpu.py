"""The MoE layer on the GPU: the grouped GEMM path (bf16, SM90+, each expert's rows padded to the
kernel's alignment) gives the per-expert loop's numbers, and the padding is counted for the logs."""

import pytest
import torch

from titan.models.moe import MoE, MoEArgs, run_grouped, run_loop
from titan.models.moe.experts import CUDA_GROUP_ALIGN, grouped_mm_supported

pytestmark = pytest.mark.cuda


def test_grouped_mm_on_the_gpu_equals_the_loop_in_bf16():
    dev = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("torch._grouped_mm needs SM90+ (Hopper) on CUDA")
    torch.manual_seed(0)
    w1, w3 = (torch.randn(4, 64, 32, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    w2 = torch.randn(4, 32, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(37, 32, device=dev, dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([11.0, 0.0, 19.0, 7.0], device=dev)
    assert grouped_mm_supported(x, w1, w2, w3)
    g = torch.randn(37, 32, device=dev, dtype=torch.bfloat16)
    results = []
    for fn in (lambda *a: run_grouped(*a, align=CUDA_GROUP_ALIGN), run_loop):
        out = fn(w1, w2, w3, x, counts)
        results.append((out.float(), *(t.float() for t in torch.autograd.grad((out * g).sum(), (x, w1, w2, w3)))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    moe = MoE(MoEArgs(num_experts=4, top_k=2), dim=32, hidden_dim=64).to(dev, torch.bfloat16)
    moe.init_weights(0.02, dev)
    moe(torch.randn(2, 16, 32, device=dev, dtype=torch.bfloat16))
    routed = moe.tokens_per_expert
    padded = ((routed + CUDA_GROUP_ALIGN - 1) // CUDA_GROUP_ALIGN * CUDA_GROUP_ALIGN - routed).sum()
    assert routed.sum().item() == 64 and moe.padded_since_log.item() == padded.item()
