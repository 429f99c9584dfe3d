"""Follows every storage the ops of a fake forward/backward create, until torch frees it, and labels
it by the module that made it (``LABELS``); a window (``open`` / ``close``) keeps what it leaves live
and its highest moment, as bytes by label (titan/training/memory/profile.py opens and closes them)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
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


# Backward nodes between a parameter and the op that uses it that only reshape it (a transposed or
# viewed weight, its compute-dtype copy): the op's gradient for that input is the parameter's.
_PASS_THROUGH = frozenset(
    {"TransposeBackward0", "TBackward0", "ViewBackward0", "UnsafeViewBackward0", "PermuteBackward0", "ToCopyBackward0"}
)


def _parameters_fed(node: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """The parameters whose gradient backward ``node`` computes (directly or through reshapes)."""
    for fn, _ in node.next_functions:
        if fn is None:
            continue
        variable = getattr(fn, "variable", None)
        if variable is not None:
            yield variable
        elif depth > 1 and type(fn).__name__ in _PASS_THROUGH:
            yield from _parameters_fed(fn, depth - 1)


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
        # parameter -> the label of its gradient from the moment backward makes it (``label_gradients``)
        self._gradient_labels: dict[int, str] = {}

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

    def label_gradients(self, parameters: Iterable[torch.Tensor], label: str) -> None:
        """Gradients of ``parameters`` get ``label`` when backward makes them, before autograd
        accumulates them: a routed experts' weight gradient is as large as the weight (every expert
        of the whole model here), a transient the rank holds for its own slice of the weight only."""
        for p in parameters:
            self._gradient_labels[id(p)] = label

    def _gradient_label(self, out: torch.Tensor) -> str | None:
        node = torch._C._current_autograd_node() if self._gradient_labels else None
        if node is None:
            return None
        own = getattr(node, "variable", None)  # autograd's accumulation: a copy in the parameter's layout
        for p in [own] if own is not None else _parameters_fed(node):
            label = self._gradient_labels.get(id(p))
            if label is not None and p.numel() == out.numel():
                return label
        return None

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
                self.add(t, "gathered" if whole else self._gradient_label(t) or self.labels[-1])
                if whole:
                    self.mark_whole(t)
        return out
