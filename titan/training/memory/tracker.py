"""Follows every storage the ops of a fake forward/backward create, until torch frees it, and labels
it by the module that made it (``LABELS``); a window (``open`` / ``close``) keeps what it leaves live
and its highest moment, as bytes by label (titan/training/memory/profile.py opens and closes them)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LABELS", "Tracker", "Window"]

LABELS = (
    *("block", "gathered", "rowwise", "whole", "router", "moe", "experts", "routed_out"),
    *("grads", "root_grads", "embed", "loss"),
)
"""Where a storage was made: ``block`` (a block's own work: attention, dense FFN, shared expert,
residuals), ``gathered`` (a sub-layer's normed input: the tensor tensor parallelism all-gathers
over the sequence), ``rowwise`` (what the output projections of attention and feed-forward make:
under TP a partial sum over the whole sequence, reduce-scattered after), ``whole`` (modules TP
runs whole on every rank, ``whole`` of profile_step), ``router`` / ``moe`` /
``experts`` (an MoE layer's router, its routing glue and its routed experts), ``routed_out`` (the
routed experts' output: under EP what the combining all-to-all returns), ``grads`` /
``root_grads`` (unsharded gradients of a block's parameters, and of the embedding, final norm and
output), ``embed`` (the embedding's output and backward), ``loss`` (output projection and loss)."""

_aten = torch.ops.aten
_MATMULS = frozenset(
    {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten._scaled_mm.default, _aten._grouped_mm.default}
)


def _zero() -> dict[str, int]:
    return dict.fromkeys(LABELS, 0)


@dataclass
class Window:
    """A piece of the step: ``kept`` (bytes by label it leaves live at its end, above what was live
    when it opened; negative where it frees what earlier windows made) and ``peak`` (the same at its
    highest moment)."""

    kept: dict[str, int] = field(default_factory=_zero)
    peak: dict[str, int] = field(default_factory=_zero)


class Tracker(TorchDispatchMode):
    """Live bytes by label, and the open window's highest moment."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = _zero()
        self.labels: list[str] = ["embed"]
        self._entries: dict[int, list] = {}
        self._start: dict[str, int] = _zero()
        self._peak_total = -1.0
        self._peak: dict[str, int] = _zero()
        self.weights = dict.fromkeys(LABELS, 1.0)
        # storages of tensors whole over the sequence that the running linear layer casts (float8),
        # by id and weakly (an id alone matches whatever storage later reuses the address)
        self.whole: dict[int, weakref.ref] = {}

    # ------------------------------------------------------------ windows
    def open(self, weights: dict[str, float] | None = None) -> None:
        """A new window; ``weights``: what each label's bytes weigh in finding its highest moment."""
        self._start = dict(self.bytes)
        self._peak_total, self._peak = 0, _zero()
        self.weights = weights or dict.fromkeys(LABELS, 1.0)

    def close(self) -> Window:
        kept = {k: self.bytes[k] - self._start[k] for k in LABELS}
        return Window(kept, dict(self._peak))

    def _update(self) -> None:
        delta = {k: self.bytes[k] - self._start[k] for k in LABELS}
        total = sum(delta[k] * self.weights[k] for k in LABELS)
        if total > self._peak_total:
            self._peak_total, self._peak = total, delta

    # ------------------------------------------------------------ storages
    def add(self, t: torch.Tensor, label: str) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._entries:
            return
        nbytes = storage.nbytes()
        self._entries[key] = [nbytes, label]
        self.bytes[label] += nbytes
        weakref.finalize(storage, self._free, key)
        self._update()

    def _free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes[entry[1]] -= entry[0]

    def relabel(self, t: torch.Tensor, label: str) -> None:
        entry = self._entries.get(id(t.untyped_storage()))
        if entry is not None and entry[1] != label:
            self.bytes[entry[1]] -= entry[0]
            self.bytes[label] += entry[0]
            entry[1] = label

    def label_of(self, t: torch.Tensor) -> str | None:
        entry = self._entries.get(id(t.untyped_storage()))
        return entry[1] if entry is not None else None

    def base(self, label: str) -> None:
        """The label of storages made outside every labelled module from now on."""
        self.labels[0] = label

    def ignore(self, tensors: Sequence[torch.Tensor]) -> None:
        """Storages that exist before the step (parameters, inputs): views of them allocate nothing."""
        for t in tensors:
            self._entries[id(t.untyped_storage())] = [0, "embed"]

    def _copies_whole(self, func: Any, args: tuple, out: torch.Tensor) -> bool:
        """An elementwise op (a cast, a scaling) of a tensor whole over the sequence: as whole."""
        if not self.whole or func in _MATMULS:
            return False
        return any(
            isinstance(a, torch.Tensor) and self.is_whole(a) and a.shape == out.shape for a in tree_flatten(args)[0]
        )

    def is_whole(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()
        ref = self.whole.get(id(storage))
        return ref is not None and ref() is storage

    def set_whole(self, tensors: Sequence[torch.Tensor]) -> dict[int, weakref.ref]:
        """Marks ``tensors`` (only) as whole over the sequence; returns the marks it replaced."""
        saved, self.whole = self.whole, {}
        for t in tensors:
            self.mark_whole(t)
        return saved

    def mark_whole(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.whole[id(storage)] = weakref.ref(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns it into ops on local tensors, which come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                whole = self._copies_whole(func, args, t)
                self.add(t, "gathered" if whole else self.labels[-1])
                if whole:
                    self.mark_whole(t)
        return out
