"""The bytes a rank holds, by category: every live tensor storage is attributed to exactly one.

``MemoryTracker`` is a dispatch mode that sees each storage an op creates (fake or real tensors:
the same code measures the simulated rank and a real gloo run) and frees it when torch does
(a weak reference to the storage). A storage's category is decided when it appears, by where the
rank is (``category()``: an explicit region such as FSDP's all-gather or the optimizer step, else
the loss tail, else the default), and moved later where its role becomes known (a reduce-scatter
output that FSDP hands over as the sharded gradient; optimizer temporaries that stay as its state).
Storages resized in place (FSDP frees and re-allocates its gathered parameters with
``UntypedStorage.resize_``, which no dispatch mode sees) are followed by wrapping that method while
the tracker is active. DTensor's sharding propagation runs each new op once on fake tensors of the
global shapes to learn its output's metadata; those allocate nothing on a device, and are left out
(through the context DTensor enters around them, ``ShardingPropagator._fake_mode_lock``).

The categories and their JSON keys are shared with the analytic estimate
(titan/training/memory.py): parameters (parameter shards and model buffers), gradients (the
gradient shards held), optimizer_state (moments, momentum), optimizer_aux (optimizer plans, step
buffers and temporaries, gradient clipping), activations (saved activations and the transients of
forward and backward), communication (collective buffers: FSDP's gathered parameters and
reduce-scatter inputs, TP/SP/CP/EP all-gather and all-to-all outputs, pipeline receive buffers),
loss (the logits and the loss computation's tensors).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._guards import active_fake_mode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from titan.training.memory.timeline import CATEGORIES  # one list: the estimate's and the simulator's

__all__ = ["CATEGORIES", "MemoryTracker", "PhasePeak"]


_c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional
# Collectives that write into a buffer handed to them (the buffer is the communication's).
_OUT_ARG = {
    _c10d._allgather_base_.default: 0,
    _c10d._reduce_scatter_base_.default: 0,
    _c10d.alltoall_base_.default: 0,
    _c10d.recv_.default: 0,
    _c10d.allgather_.default: 0,
}
# Collectives that return a new tensor (functional collectives): the result is communication.
_RETURNS_BUFFER = {
    _functional.all_gather_into_tensor.default,
    _functional.reduce_scatter_tensor.default,
    _functional.all_to_all_single.default,
    _functional.all_reduce.default,
    _functional.all_gather_into_tensor_coalesced.default,
    _functional.reduce_scatter_tensor_coalesced.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_gather_into_tensor.default,
    torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default,
    torch.ops._dtensor.shard_dim_alltoall.default,
}


def _storages(obj: Any) -> Iterator[torch.UntypedStorage]:
    """The storages under the tensors in ``obj``: a wrapper subclass (DTensor, float8's tensors)
    holds none of its own, its inner tensors do."""
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor):
            yield from get_untyped_storages(t)


@dataclass
class PhasePeak:
    """The largest total of one phase and the bytes of every category at that moment."""

    total: int = 0
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))

    def plus(self, extra: dict[str, int]) -> PhasePeak:
        merged = {k: self.bytes[k] + extra.get(k, 0) for k in CATEGORIES}
        return PhasePeak(sum(merged.values()), merged)


class _Entry:
    __slots__ = ("category", "nbytes")

    def __init__(self, nbytes: int, category: str) -> None:
        self.nbytes, self.category = nbytes, category


class MemoryTracker(TorchDispatchMode):
    """Live bytes by category, and each phase's peak (``phase(name)``). ``default`` is the category
    of storages created outside every region (set by the caller: parameters while the model is
    materialized, activations during the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.default = "parameters"
        self.loss_tail = False  # between the output projection's forward and its input's gradient
        self.current_phase = "setup"
        self.peaks: dict[str, PhasePeak] = {}
        # each phase's moment of most activations (a deep model's start of backward): the depth
        # extrapolation's second candidate, for short runs whose peak comes elsewhere
        self.activation_peaks: dict[str, PhasePeak] = {}
        self._regions: list[str] = []
        self._entries: dict[int, _Entry] = {}
        self._fake = None
        self._resize: Any = None
        self._lock: Any = None
        self._propagating = 0  # inside DTensor's metadata propagation: not a device allocation

    # ------------------------------------------------------------ where the rank is
    def category(self) -> str:
        if self._regions:
            return self._regions[-1]
        return "loss" if self.loss_tail else self.default

    @contextlib.contextmanager
    def region(self, category: str) -> Iterator[None]:
        """Storages created inside belong to ``category`` (unless moved later)."""
        self._regions.append(category)
        try:
            yield
        finally:
            self._regions.pop()

    def phase(self, name: str) -> None:
        """From now on peaks count towards phase ``name`` (forward_backward, clip, optimizer, ...)."""
        self.current_phase = name
        self.peaks.setdefault(name, PhasePeak(self.total, dict(self.bytes)))

    # ------------------------------------------------------------ storages
    def _add(self, storage: torch.UntypedStorage, category: str) -> None:
        key = id(storage)
        entry = self._entries.get(key)
        if entry is not None:
            return
        nbytes = storage.nbytes()
        self._entries[key] = _Entry(nbytes, category)
        self.bytes[category] += nbytes
        self.total += nbytes
        weakref.finalize(storage, self._free, key)
        self._update_peak()

    def _free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes[entry.category] -= entry.nbytes
            self.total -= entry.nbytes

    def _update_peak(self) -> None:
        peak = self.peaks.get(self.current_phase)
        if peak is None or self.total > peak.total:
            self.peaks[self.current_phase] = PhasePeak(self.total, dict(self.bytes))
        most = self.activation_peaks.get(self.current_phase)
        if most is None or self.bytes["activations"] > most.bytes["activations"]:
            self.activation_peaks[self.current_phase] = PhasePeak(self.total, dict(self.bytes))

    def tag(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Move the storages of ``tensors`` to ``category`` (adding those not seen yet)."""
        for storage in _storages(list(tensors)):
            entry = self._entries.get(id(storage))
            if entry is None:
                self._add(storage, category)
            elif entry.category != category:
                self.bytes[entry.category] -= entry.nbytes
                self.bytes[category] += entry.nbytes
                entry.category = category

    # ------------------------------------------------------------ the mode
    def __enter__(self) -> MemoryTracker:
        self._fake = active_fake_mode()
        original = torch.UntypedStorage.resize_
        self._resize = original
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            entry = tracker._entries.get(id(storage))
            if entry is None:
                tracker._add(storage, tracker.category())
            elif entry.nbytes != storage.nbytes():
                delta = storage.nbytes() - entry.nbytes
                entry.nbytes += delta
                tracker.bytes[entry.category] += delta
                tracker.total += delta
                tracker._update_peak()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._lock = ShardingPropagator._fake_mode_lock
        ShardingPropagator._fake_mode_lock = self._not_tracked(self._lock)  # type: ignore[assignment]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        ShardingPropagator._fake_mode_lock = self._lock
        super().__exit__(*args)

    def _not_tracked(self, lock: Any) -> Any:
        tracker = self

        class _Region:
            def __enter__(self) -> None:
                lock.__enter__()
                tracker._propagating += 1

            def __exit__(self, *args: Any) -> None:
                tracker._propagating -= 1
                lock.__exit__(*args)

        return _Region()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # DTensor first turns the op into ops on local shards, which come back here.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func is _functional.wait_tensor.default and self._fake is not None:
            # The fake kernel returns a new tensor; eager returns its argument (no new storage).
            return args[0]
        out = func(*args, **(kwargs or {}))
        # Ops run by DTensor's sharding propagation on global-shape fake tensors allocate nothing real.
        if self._propagating or active_fake_mode() is not self._fake:
            return out
        if func in _RETURNS_BUFFER:
            category = "communication"
        else:
            category = self.category()
            index = _OUT_ARG.get(func)
            if index is not None:
                self.tag(tree_flatten(args[index])[0], "communication")
        for storage in _storages(out):
            self._add(storage, category)
        return out
