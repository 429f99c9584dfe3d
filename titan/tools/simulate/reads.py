"""Device-to-host reads: counted, and answered where the tensors are fake.

A read of a tensor's value into Python (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``: each
reaches the dispatcher as ``_local_scalar_dense`` per element; ``.cpu()`` and ``.numpy()``) makes
the host wait for the device. ``HostReads`` counts those of device data while ``counting`` (one read
per call, however many elements it returns). Host tensors (real CPU tensors under the simulator's
fake ones: device-mesh coordinates) are read as they are and not counted; a fake tensor whose
value the fake mode knows is read as it is too; any other fake tensor stands for device data with
no value, so its read returns ``answer`` (0 / False unless a caller states another assumption with
``answering``: the pipeline schedule's warm-up vote does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, is_fake
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

_SCALAR = torch.ops.aten._local_scalar_dense.default
_COPIES_TO_HOST = frozenset({torch.Tensor.cpu, torch.Tensor.numpy})


def _on_device(t: Any) -> bool:
    """Whether ``t``'s value lives on the device (what a read waits for)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if isinstance(t, FakeTensor):
        return t.constant is None
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


class _Copies(TorchFunctionMode):
    """``.cpu()`` / ``.numpy()``: no dispatcher op on a CPU-resident tensor, so caught by name."""

    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _COPIES_TO_HOST and args and _on_device(args[0]):
            self.reads.count(func.__name__)
        return func(*args, **(kwargs or {}))


class HostReads(TorchDispatchMode):
    """Counts device-to-host reads by kind while ``counting``; answers them on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.reads: dict[str, int] = {}
        self.answer: Any = 0
        self.assumed = 0  # reads of fake device data answered by an assumption, in or out of the step
        self._last: int | None = None  # the storage of the read in progress (tolist reads element by element)
        self._copies = _Copies(self)

    def count(self, kind: str) -> None:
        if self.counting:
            self.reads[kind] = self.reads.get(kind, 0) + 1

    @contextlib.contextmanager
    def answering(self, value: Any) -> Iterator[None]:
        """Reads of fake device data inside return ``value`` (a stated assumption)."""
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
        if _on_device(t):
            storage = id(t.untyped_storage())
            if storage != self._last:  # a new read (not the next element of the same tolist)
                self.count("item/tolist")
            self._last = storage
        if not is_fake(t):
            return func(*args, **(kwargs or {}))
        try:
            return func(*args, **(kwargs or {}))  # a value the fake mode knows
        except DataDependentOutputException:
            self.assumed += 1
            return bool(self.answer) if t.dtype == torch.bool else self.answer
