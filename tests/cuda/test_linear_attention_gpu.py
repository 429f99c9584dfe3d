"""The Gated DeltaNet on CUDA: flash-linear-attention's kernels (model.linear_attn_backend fla) give
the exact torch path's outputs and gradients within bf16's tolerance, one sequence per row and with
packed documents (fla's cu_seqlens against the torch path's document masks)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from titan.models.linear_attention import DocumentSpans, GatedDeltaNet
from titan.models.llama.masks import varlen_mask

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        importlib.util.find_spec("fla") is None, reason="needs fla-core (pip install 'titan[linear_attention]')"
    ),
]


def _pair() -> tuple[GatedDeltaNet, GatedDeltaNet]:
    torch.manual_seed(0)
    ref = GatedDeltaNet(256, 2, 4, 64, 64, backend="torch").cuda()
    ref.init_weights(0.02)
    fla = GatedDeltaNet(256, 2, 4, 64, 64, backend="fla").cuda()
    fla.load_state_dict(ref.state_dict())
    return ref, fla


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("packed", [False, True])
def test_fla_kernels_match_the_torch_path(packed: bool) -> None:
    ref, fla = _pair()
    x = torch.randn(2, 300, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    docs = None
    if packed:  # documents of 100, 120 and 80 tokens in row 0; one in row 1
        ids = torch.zeros(2, 300, dtype=torch.int32, device="cuda")
        ids[0, 100:], ids[0, 220:] = 1, 2
        docs = DocumentSpans(ids, varlen_mask(ids).cu_seqlens.long())
    outs, grads = [], []
    for gdn in (ref, fla):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = gdn(xi, attn_mask=docs)
        out.float().square().mean().backward()
        outs.append(out)
        grads.append(torch.cat([xi.grad.flatten(), gdn.A_log.grad.flatten(), gdn.conv_q.weight.grad.flatten()]))
    assert _rel(outs[1], outs[0]) < 2e-2
    assert _rel(grads[1], grads[0]) < 3e-2
