"""gpt_oss on the GPU: the flex sink attention (compiled flex_attention, out * sigmoid(lse - sink))
trains with the eager sink attention's numbers, full and sliding-window layers, and the experts'
grouped GEMM path with biases (rows padded to the kernel's alignment) gives the loop's."""

import dataclasses

import pytest
import torch

from titan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe
from titan.models.gpt_oss.model import GptOssTransformer
from titan.models.moe import run_grouped, run_loop
from titan.models.moe.experts import CUDA_GROUP_ALIGN, clamped_swiglu

pytestmark = pytest.mark.cuda


def test_flex_sink_attention_trains_like_the_eager_one():
    dev = torch.device("cuda", 0)
    moe = dataclasses.replace(gpt_oss_moe(4), top_k=2, hidden_dim=64, use_grouped_mm=False)
    args = GptOssModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256,
                           max_seq_len=256, sliding_window_size=40, rope_factor=4.0, original_seq_len=64,
                           moe_args=moe)  # fmt: skip
    torch.manual_seed(0)
    eager = GptOssTransformer(args).to(dev)
    eager.init_weights()
    flex = GptOssTransformer(dataclasses.replace(args, attn_type="flex")).to(dev)
    flex.load_state_dict(eager.state_dict())
    flex.init_buffers(dev)
    with torch.no_grad():
        for m in (eager, flex):
            for name, p in m.named_parameters():
                if "sinks" in name:
                    p.copy_(torch.linspace(-2, 2, p.numel()))
    tokens = torch.randint(0, 256, (2, 256), device=dev)
    outs = []
    for m in (eager, flex):
        logits = m(tokens)
        logits.float().square().mean().backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-4, rtol=1e-4)
    for name, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], g, atol=2e-4, rtol=1e-3, msg=name)


def test_grouped_experts_with_biases_equal_the_loop_in_bf16():
    dev = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("torch._grouped_mm needs SM90+ (Hopper) on CUDA")
    torch.manual_seed(0)
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    w1, w3 = (torch.randn(4, 64, 32, **bf16) * 0.3 for _ in range(2))
    w2 = torch.randn(4, 32, 64, **bf16) * 0.3
    biases = (torch.randn(4, 64, **bf16), torch.randn(4, 32, **bf16), torch.randn(4, 64, **bf16))
    x = torch.randn(37, 32, **bf16)
    counts = torch.tensor([11.0, 0.0, 19.0, 7.0], device=dev)

    def act(g, u):
        return clamped_swiglu(g, u, 7.0, 1.702)

    grouped = run_grouped(w1, w2, w3, x, counts, CUDA_GROUP_ALIGN, act=act, biases=biases)
    loop = run_loop(w1, w2, w3, x, counts, act=act, biases=biases)
    torch.testing.assert_close(grouped.float(), loop.float(), atol=5e-2, rtol=2e-2)
