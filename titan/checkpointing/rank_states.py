"""Per-rank state beside the DCP files: each rank's ``rank_<r>.pt``, and what a resuming rank sees of it.

A checkpoint's per-rank Stateful objects (RNG, data loader position) differ from rank to rank and
hold no tensors worth sharding, so each rank writes ``{name: state_dict()}`` of them with
``torch.save`` into ``step-N/rank_<r>.pt`` (to a temporary name, then renamed) before DCP writes
its files. The manifest lists these files like the DCP ones: a torn or missing one makes the
checkpoint damaged, and auto-resume passes over it.

On resume each per-rank Stateful gets a ``SavedRankStates``: the state this rank saved (``mine``)
and every saved rank's (``all``), read lazily with ``torch.load(weights_only=True)``. An object
that can take a different layout's states (the data loader re-deals unread documents when the dp
degree changed) has ``load_rank_states(saved)``; any other gets ``load_state_dict(saved.mine())``.

Checkpoints written before these files kept per-rank state inside DCP as pickled bytes under
``<name>.rank_<r>`` (indexed by global rank) or ``<name>.dp_rank_<d>`` (by dp rank, one per dp
rank); ``legacy_request`` and ``legacy_saved`` read those into the same ``SavedRankStates``.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Callable, Collection
from typing import Any

import torch

RANK_FILE = "rank_{}.pt"
_RANK_FILE = re.compile(r"^rank_(\d+)\.pt$")
_LEGACY_KEY = re.compile(r"^(\w+)\.(dp_rank|rank)_(\d+)$")


class SavedRankStates:
    """One per-rank Stateful's states as saved by every rank of the run that wrote a checkpoint."""

    def __init__(self, indices: list[int], read: Callable[[int], Any], my_index: int) -> None:
        self._indices, self._read, self._my_index = sorted(indices), read, my_index

    def mine(self) -> Any:
        """The state this rank saved; None if the saving run had no such rank."""
        return self._read(self._my_index) if self._my_index in self._indices else None

    def all(self) -> list[Any]:
        """Every saved state, in saved-rank order."""
        return [self._read(i) for i in self._indices]

    def __bool__(self) -> bool:
        return bool(self._indices)


def write_rank_file(folder: str, rank: int, states: dict[str, Any]) -> None:
    """``{name: state}`` of this rank into ``folder/rank_<rank>.pt``, never seen half-written."""
    path = os.path.join(folder, RANK_FILE.format(rank))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(states, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RankFiles:
    """The ``rank_<r>.pt`` files of one checkpoint folder, each read once, on first use."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        names = os.listdir(folder) if os.path.isdir(folder) else []
        self.ranks = sorted(int(m[1]) for n in names if (m := _RANK_FILE.match(n)))
        self._read: dict[int, dict[str, Any]] = {}

    def _file(self, rank: int) -> dict[str, Any]:
        if rank not in self._read:
            path = os.path.join(self.folder, RANK_FILE.format(rank))
            self._read[rank] = torch.load(path, map_location="cpu", weights_only=True)
        return self._read[rank]

    def saved(self, name: str, rank: int) -> SavedRankStates:
        """``name``'s states (empty if the saving run had no such state: every rank saves the same
        names, so the first file tells); this rank's own is the file of its global rank."""
        has = self.ranks if self.ranks and name in self._file(self.ranks[0]) else []
        return SavedRankStates(has, lambda r: self._file(r)[name], rank)


def legacy_request(keys: Collection[str], names: Collection[str]) -> dict[str, dict[str, bytes]]:
    """The DCP state dict that reads an older checkpoint's per-rank blobs of ``names``: DCP fills
    each ``b""`` with the saved bytes."""
    request: dict[str, dict[str, bytes]] = {}
    for key in keys:
        m = _LEGACY_KEY.match(key)
        if m and m[1] in names:
            request.setdefault(m[1], {})[f"{m[2]}_{m[3]}"] = b""
    return request


def legacy_saved(loaded: dict[str, dict[str, bytes]], rank: int, dp_rank: int) -> dict[str, SavedRankStates]:
    """The blobs ``legacy_request`` read, as ``SavedRankStates``: one entry per saved rank (global
    ranks for ``rank_<r>`` keys, dp ranks for ``dp_rank_<d>`` keys, where this rank's own is the
    one of its dp rank)."""
    out = {}
    for name, blobs in loaded.items():
        by_index = {int(key.rsplit("_", 1)[1]): blob for key, blob in blobs.items()}
        mine = dp_rank if next(iter(blobs)).startswith("dp_rank_") else rank
        out[name] = SavedRankStates(list(by_index), lambda i, b=by_index: pickle.loads(b[i]), mine)
    return out
