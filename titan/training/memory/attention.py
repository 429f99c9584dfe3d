"""The attention kernel a CUDA rank runs, for a profile whose fake tensors sit on the CPU.

On the CPU, SDPA takes torch's CPU Flash kernel or, where that declines (values narrower than
queries, as in latent attention), the math path, which materialises every score: at 4,096 tokens
and 128 heads that is gigabytes a GPU never holds. On CUDA titan's kernels (titan/models/sdpa.py)
save what Flash / cuDNN save (the output and a float32 log-sum-exp per query) or, with an explicit
mask, float32 or narrower values, what the memory-efficient kernel saves (the same, padded). Inside
``cuda_attention`` ``F.scaled_dot_product_attention`` calls those CUDA operators, whose fake
implementations run on any device; grouped-query heads outside Flash go to torch's own composite,
as on CUDA. The function itself is swapped while the profile runs: activation checkpointing
recomputes the forward where a torch-function mode is not active.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["cuda_attention"]

_aten = torch.ops.aten
_FLASH_HEAD_DIM = 256  # the widest head Flash attention takes


def _cuda_kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The CUDA kernel's output, or None where CUDA too takes the composite (math) path."""
    if (
        attn_mask is None
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] == v.shape[-1] <= _FLASH_HEAD_DIM
    ):
        return _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if q.shape[1] == k.shape[1]:  # the memory-efficient kernel takes no grouped-query heads
        out = _aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)
        return out[0]
    return None


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    original = F.scaled_dot_product_attention

    @functools.wraps(original)
    def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = _cuda_kernel(*args, **kwargs)
        return original(*args, **kwargs) if out is None else out

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
