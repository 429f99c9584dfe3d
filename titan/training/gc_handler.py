"""Garbage collection during training: off automatically, collected at fixed steps instead.

Python's automatic collector runs whenever allocations cross a threshold, so ranks pause at
different moments and the fast ones wait for the slow ones in the next collective. With it off,
every rank collects at the same steps (``training.gc_freq``). The interpreter's setting is
process-wide: the handler puts back what it found when it closes, also when the run raised, so
code after a run (tests, tools, a second run in the same process) keeps its own setting.
"""

from __future__ import annotations

import gc
from types import TracebackType

from titan.errors import TitanError

__all__ = ["GarbageCollection"]


class GarbageCollection:
    """``with GarbageCollection(freq) as collector: ... collector.step(step)`` - automatic
    collection is off inside the block and restored after it."""

    def __init__(self, freq: int, generation: int = 1) -> None:
        if freq < 1:
            raise TitanError(f"config key 'training.gc_freq' must be >= 1, got {freq}")
        self.freq = freq
        self.generation = generation
        self._was_enabled: bool | None = None  # None: not active

    def __enter__(self) -> GarbageCollection:
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def step(self, step: int) -> None:
        """Collect on the steps that are multiples of ``freq``."""
        if step % self.freq == 0:
            gc.collect(self.generation)

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
