"""SIGTERM / SIGUSR1: finish the current step, save, exit 0 (Slurm --signal, spot instances, k8s).

The handler only sets a flag (safe at any point in the step). After each step the ranks agree
with one tiny all-reduce (MAX) on a CPU gloo group, so a signal that reached only some ranks still
stops all of them at the same step, and the GPU stream is never synchronized for it.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from titan.log import logger

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def should_stop(self) -> bool:
        """True on every rank when any rank got a signal (a collective when distributed)."""
        flag = self.received is not None
        if self.group is not None:
            t = torch.tensor([1 if flag else 0], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flag = bool(t.item())
        if flag:
            name = signal.Signals(self.received).name if self.received else "a signal on another rank"
            logger.warning(f"received {name}: saving a checkpoint after this step, then exiting")
        return flag
