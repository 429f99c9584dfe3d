"""Device-to-host reads: counted, and answered where the tensors are fake.

A read of a tensor's value into Python (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``: each
reaches the dispatcher as ``_local_scalar_dense`` per element; ``.cpu()`` and ``.numpy()``) makes
the host wait for the device. ``HostReads`` counts them while ``counting`` (one read per call that
reads, however many elements it returns) and, under fake tensors, answers them: a fake tensor has
no value, so a read returns ``answer`` (0 / False unless a caller states another assumption with
``answering``; expert parallelism's split sizes and the pipeline's warm-up vote state theirs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPIES_TO_HOST = frozenset({torch.Tensor.cpu, torch.Tensor.numpy})


class _Copies(TorchFunctionMode):
    """``.cpu()`` / ``.numpy()``: no dispatcher op on a CPU-resident tensor, so caught by name."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _COPIES_TO_HOST:
            self.reads.count(func.__name__)
        return func(*args, **(kwargs or {}))


class HostReads(TorchDispatchMode):
    """Counts host reads by kind while ``counting``; answers them on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.reads: dict[str, int] = {}
        self.answer: Any = 0
        self._last: int | None = None  # the storage of the read in progress (tolist reads element by element)
        self._copies = _Copies(self)

    @property
    def total(self) -> int:
        return sum(self.reads.values())

    def count(self, kind: str) -> None:
        if self.counting:
            self.reads[kind] = self.reads.get(kind, 0) + 1

    @contextlib.contextmanager
    def answering(self, value: Any) -> Iterator[None]:
        """Reads of fake tensors inside return ``value`` (a stated assumption)."""
        previous, self.answer = self.answer, value
        try:
            yield
        finally:
            self.answer = previous

    def __enter__(self) -> HostReads:
        super().__enter__()
        self._copies.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        self._copies.__exit__(*args)
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func is not _SCALAR:
            self._last = None
            return func(*args, **(kwargs or {}))
        t = args[0]
        storage = id(t.untyped_storage())
        if storage != self._last:  # a new read (not the next element of the same tolist)
            self.count("item/tolist")
        self._last = storage
        if not is_fake(t):
            return func(*args, **(kwargs or {}))
        return bool(self.answer) if t.dtype == torch.bool else self.answer
