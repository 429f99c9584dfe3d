"""Key/value cache for incremental decoding, shared by model families (pure torch).

A model's attention takes it as an optional argument: with a cache, the new tokens' keys and
values are written at positions ``pos .. pos + S`` and attention runs over everything cached so
far. The caller (generation) advances ``pos`` by the real tokens fed; padded slots past them are
overwritten by the next chunk, and no real query attends to them (causal).

A recurrent layer (linear attention) keeps its state instead, one slot per layer
(``state`` / ``set_state``); it cannot take padded slots, so its families generate on one rank.
"""

from __future__ import annotations

from typing import Any

import torch

from titan.errors import TitanError


class KVCache:
    """Per-layer [B, max_len, kv_heads, head_dim] buffers, allocated on first use (sized from the
    first keys, so a TP rank holds only its local heads)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.pos = 0
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._states: dict[int, Any] = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, S, KVH, Dh] of ``layer`` at pos .. pos + S; return keys/values 0 .. pos + S."""
        start, end = self.pos, self.pos + k.shape[1]
        if end > self.max_len:
            raise TitanError(f"the KV cache holds {self.max_len} positions; generation reached {end}")
        if layer not in self._kv:
            # k and v sized apart: latent attention's values are narrower than its keys.
            self._kv[layer] = tuple(t.new_zeros(t.shape[0], self.max_len, *t.shape[2:]) for t in (k, v))  # type: ignore[assignment]
        ck, cv = self._kv[layer]
        ck[:, start:end], cv[:, start:end] = k, v
        return ck[:, :end], cv[:, :end]

    def state(self, layer: int) -> Any:
        """The recurrent state ``layer`` stored after the previous chunk (None before the prompt)."""
        return self._states.get(layer)

    def set_state(self, layer: int, state: Any) -> None:
        self._states[layer] = state

    def advance(self, n: int) -> None:
        self.pos += n
