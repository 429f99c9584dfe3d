"""RoPE frequency variants shared by the families: YaRN context extension (DeepSeek-V3, gpt-oss).

Llama 3.1's scaling stays beside llama's model (it predates this module and only llama-class args
use it). Each function returns the per-pair inverse frequencies [head_dim // 2] in fp32; the
caller builds its rotation table from them, in its own pair layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YarnScaling:
    """YaRN (Peng et al. 2023) as transformers' ``rope_type = "yarn"`` reads it."""

    factor: float
    """How many times the pretrained context the positions are stretched to (> 1)."""
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    """Pairs that turn more than beta_fast times over the original context keep their frequency."""
    beta_slow: float = 1.0
    """Pairs that turn less than beta_slow times are interpolated (divided by factor)."""
    truncate: bool = True
    """Round the blend range outward to whole pairs (gpt-oss sets False)."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    """Scale of cos/sin (so of q.k by its square); None: derived from factor (and the mscales)."""

    def cos_sin_scale(self) -> float:
        """The factor transformers multiplies cos and sin by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def default_inv_freq(dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """theta ** (-2j / dim) for j < dim / 2, fp32."""
    return 1.0 / _pair_wavenumbers(dim, theta, device)


def _pair_wavenumbers(dim: int, theta: float, device: torch.device | str | None) -> torch.Tensor:
    return theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies of YaRN: fast-turning pairs kept, slow ones divided by ``factor``, a
    linear blend between (over pair indices, from the pairs' turns over the original context)."""

    def pair_index(turns: float) -> float:  # the pair that turns ``turns`` times over the original context
        ctx = yarn.original_max_position_embeddings
        return dim * math.log(ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_index(yarn.beta_fast), pair_index(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width blend would divide by zero
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the pair keeps its frequency (extrapolation), 0: divided by factor
    # The same operation order as transformers: its tables are then bitwise ours.
    wavenumbers = _pair_wavenumbers(dim, theta, device)
    return 1.0 / (yarn.factor * wavenumbers) * (1 - keep) + 1.0 / wavenumbers * keep
