"""scaled_dot_product_attention for the models: grouped-query heads read in place, and the fused
kernels chosen per device.

Grouped-query attention: with fewer key/value heads than query heads, query head h reads key/value
head h // (n_heads / n_kv_heads). SDPA does that itself (``enable_gqa``), so the models never copy
k/v to the query head count (that copy wrote and read n_rep times the k/v bytes in every layer,
forward and backward).

Kernels, in priority order (``torch.nn.attention.sdpa_kernel`` with ``set_priority``; torch takes the
first one that accepts the inputs):

- CUDA: cuDNN attention, Flash, memory-efficient, math. cuDNN attention is the fastest on Hopper
  and takes grouped-query heads; Flash takes grouped-query heads but no explicit mask;
  memory-efficient takes a mask but not grouped-query heads (block-causal masks of models with as
  many k/v heads as query heads land there when cuDNN declines); math takes everything (and copies
  grouped k/v itself). With deterministic algorithms on (training.deterministic) cuDNN is left out:
  its backward is not covered by torch's deterministic switch.
- CPU: torch's CPU Flash kernel (grouped-query heads, masks, fp32/bf16), then math.
- other devices: torch's own choice.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["sdpa", "sdpa_backends"]


def sdpa_backends(device_type: str, deterministic: bool = False) -> list[SDPBackend] | None:
    """The SDPA kernels for ``device_type`` in priority order; None: leave the choice to torch."""
    if device_type == "cuda":
        if deterministic:
            return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        return [
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]
    if device_type == "cpu":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    return None


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on [B, H, S, Dh] q and [B, KVH, S, Dh] k/v (H a multiple
    of KVH) under the device's kernels (see the module docstring)."""
    backends = sdpa_backends(q.device.type, torch.are_deterministic_algorithms_enabled())
    ctx = sdpa_kernel(backends, set_priority=True) if backends is not None else contextlib.nullcontext()
    with ctx:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1]
        )
