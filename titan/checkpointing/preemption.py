"""SIGTERM / SIGUSR1: finish the current step, save (with checkpointing on), exit 0 (Slurm
--signal, spot instances, k8s, a user's kill).

The handler only sets a flag (safe at any point in the step). After each step the ranks agree
with one tiny all-reduce (MAX) on a CPU gloo group, so a signal that reached only some ranks still
stops all of them at the same step, and the GPU stream is never synchronized for it. Other per-step
flags of the ranks (the in-memory snapshot in flight) ride on the same all-reduce.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from titan.log import logger

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatcher:
    def __init__(self, group: dist.ProcessGroup | None, saving: bool = True) -> None:
        self.group, self.saving = group, saving
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
        return bool(self.agree()[0])

    def agree(self, *flags: int) -> tuple[int, ...]:
        """(stop, then the maximum over the ranks of each of ``flags``): one collective."""
        out = (1 if self.received is not None else 0, *flags)
        if self.group is not None:  # a CPU tensor on a gloo group: no device is waited for
            t = torch.tensor(out, dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            out = tuple(int(x) for x in t.tolist())
        if out[0]:
            name = signal.Signals(self.received).name if self.received else "a signal on another rank"
            then = "saving a checkpoint after this step" if self.saving else "stopping after this step without a save"
            off = "" if self.saving else " (checkpoint.enable is off)"
            logger.warning(f"received {name}: {then}, then exiting{off}")
        return out
