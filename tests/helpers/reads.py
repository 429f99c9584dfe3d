"""Count what titan's code reads from tensors on the host and which collectives it calls, by
patching torch until the caller undoes the patches (``undo``)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

TITAN = Path(__file__).resolve().parents[2] / "titan"
HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def count(counts: Counter, patched: list, collectives: Sequence[str] = ()) -> None:
    """Host reads from titan's code ("host reads") and each named torch.distributed collective's
    calls and bytes (the larger buffer: "<name> calls" / "<name> bytes") into ``counts``."""
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *a, _original=original, **k):
            if TITAN in Path(sys._getframe(1).f_code.co_filename).parents:
                counts["host reads"] += 1
            return _original(self, *a, **k)

        patched.append((torch.Tensor, name, original))
        setattr(torch.Tensor, name, read)
    for name in collectives:
        original = getattr(dist, name)

        def collective(*a, _original=original, _name=name, **k):
            tensors = [t for t in (*a, *k.values()) if isinstance(t, torch.Tensor)]
            counts[f"{_name} calls"] += 1
            counts[f"{_name} bytes"] += max(t.numel() * t.element_size() for t in tensors)
            return _original(*a, **k)

        patched.append((dist, name, original))
        setattr(dist, name, collective)


def undo(patched: list) -> None:
    for owner, name, original in reversed(patched):
        setattr(owner, name, original)
    patched.clear()
