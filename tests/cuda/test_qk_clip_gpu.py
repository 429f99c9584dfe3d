"""The largest attention logit on CUDA, from the paths CPUs cannot run: flex_attention's own per-row
maximum (llama's flex kernel and gpt-oss's flex sink kernel, compiled) and the flash varlen kernel's
document boundaries, each against the scores written out whole; and a short flex run with QK-clip."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from tests.cuda._common import metric_rows, train
from titan.models.gpt_oss.attention import SinkAttention, block_masks, dense_masks
from titan.models.llama.kernels import FlexAttention, VarlenAttention
from titan.models.llama.masks import block_causal_dense, varlen_mask

pytestmark = pytest.mark.cuda
B, H, KVH, S, D = 2, 4, 2, 256, 16


def _qkv(dtype: torch.dtype = torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(B, h, S, D, device="cuda", generator=g, dtype=dtype) * 2 for h in (H, KVH, KVH))


def _reference(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    scores = q.double() @ k.double().repeat_interleave(H // KVH, dim=1).transpose(-2, -1) * D**-0.5
    return scores.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3)).float()


def _docs() -> torch.Tensor:
    docs = torch.zeros(B, S, dtype=torch.long, device="cuda")
    docs[0, 70:] = 1
    docs[1, 130:] = 1
    return docs


def test_flex_kernel_takes_flex_attentions_own_maximum():
    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v = _qkv()
    docs = _docs()

    def same_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    kernel = FlexAttention()
    kernel.start_tracking(H, q.device)
    kernel(q, k, v, create_block_mask(same_document, B, None, S, S, device="cuda"))
    torch.testing.assert_close(kernel.max_logits, _reference(q, k, block_causal_dense(docs)), rtol=1e-4, atol=1e-4)


def test_flash_varlen_kernel_tracks_its_documents():
    q, k, v = _qkv(torch.bfloat16)
    docs = _docs()
    kernel = VarlenAttention()
    kernel.start_tracking(H, q.device)
    kernel(q, k, v, varlen_mask(docs))
    torch.testing.assert_close(kernel.max_logits, _reference(q, k, block_causal_dense(docs)), rtol=2**-7, atol=0)


def test_flex_sink_kernel_takes_flex_attentions_own_maximum():
    from titan.models.gpt_oss.attention import FlexSinkKernel

    torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v = _qkv()
    sinks = torch.linspace(-1, 1, H, device="cuda")
    kernel = SinkAttention(D**-0.5, FlexSinkKernel())
    kernel.start_tracking(H, q.device)
    kernel(q, k, v, sinks, block_masks(S, 40, q.device, None).sliding)
    allowed = dense_masks(S, 40, q.device, None).sliding[:, None]
    torch.testing.assert_close(kernel.max_logits, _reference(q, k, allowed), rtol=1e-4, atol=1e-4)


def test_flex_training_clips_on_cuda(tmp_path):
    losses, _ = train(tmp_path, 4, "--model.attn_type", "flex", "--optimizer.qk_clip_threshold", "0.5")
    rows = metric_rows(tmp_path)
    assert all(math.isfinite(x) for x in losses)
    assert all(math.isfinite(rows[s]["max_logit"]) and rows[s]["qk_clipped_heads"] >= 0 for s in rows)
