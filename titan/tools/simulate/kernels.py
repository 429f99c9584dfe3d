"""The attention kernel a CUDA rank runs, where the simulated rank's fake tensors sit on the CPU.

titan picks SDPA kernels by device (titan/models/sdpa.py): on CUDA cuDNN or Flash attention
(bf16/fp16, no explicit mask, values as wide as queries), the memory-efficient kernel (explicit
masks, float32, narrower values as in latent attention), math last;
on the CPU torch's CPU Flash kernel, which saves other tensors and has no context-parallel rule.
``cuda_attention`` sends ``F.scaled_dot_product_attention`` to the CUDA kernel's operator instead
(Flash: what it saves is what cuDNN saves, the output and a float32 log-sum-exp per query; the
memory-efficient kernel for masks and float32), whose fake implementation runs on any device and
which torch's context-parallel ring attention dispatches. The function itself is swapped while the
simulation runs (as titan/parallel/init.py swaps nn.init's): activation checkpointing recomputes
the forward where no torch-function mode is active.
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


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    grouped = q.shape[1] != k.shape[1]
    flash_dtype = q.dtype in (torch.bfloat16, torch.float16)
    if attn_mask is None and flash_dtype and q.shape[-1] == v.shape[-1] and q.shape[-1] <= 256:
        return _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if not grouped:
        return _aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]
    return None  # CUDA runs math here too: torch's own composite


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    original = F.scaled_dot_product_attention

    @functools.wraps(original)
    def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = _attention(*args, **kwargs)
        return original(*args, **kwargs) if out is None else out

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
