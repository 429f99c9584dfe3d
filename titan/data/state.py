"""The data loaders' state, typed: a stream's position, a loader's streams, a mixture's counters.

In memory the loaders keep these dataclasses; ``to_dict()`` turns one into plain Python (dicts,
lists, ints, str, None), the form a checkpoint stores (a per-rank file loads with
``torch.load(weights_only=True)``), and ``from_dict()`` reads that form back. The stored form is
state version 2: cursors and buffered segments as short lists (``[position, row]``,
``[position, row, token_offset]``), so a state written by any version-2 loader restores exactly.
What each field means: titan/data/packing.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import torch

from titan.errors import TitanError

__all__ = [
    "STATE_VERSION",
    "Cursor",
    "LoaderState",
    "MixtureState",
    "SavedRankStates",
    "Segment",
    "StreamBatch",
    "StreamState",
    "WorkerError",
    "one_state_per_dp_rank",
]

STATE_VERSION = 2
MIXTURE_STATE_VERSION = 1


@dataclass(frozen=True)
class Cursor:
    """A place to read from: row ``row`` of the unit at global position ``position``."""

    position: int
    row: int = 0


@dataclass(frozen=True)
class Segment:
    """A buffered document: row ``row`` of unit ``position``, tokens from ``offset`` not yet emitted."""

    position: int
    row: int
    offset: int


@dataclass
class StreamState:
    """One stream's whole future (titan/data/packing.py): its own positions are slot, slot + stride, ..."""

    slot: int
    stride: int
    next: int
    pending: list[Cursor] = field(default_factory=list)
    cur: Cursor | None = None
    segments: list[Segment] = field(default_factory=list)
    epoch: int = 0
    num_units: int | None = None
    docs: int = 0

    @classmethod
    def new(cls, slot: int, stride: int, num_units: int | None) -> StreamState:
        return cls(slot=slot, stride=stride, next=slot, num_units=num_units)

    def clone(self) -> StreamState:
        # cursors and segments are frozen: copying the lists is a deep copy
        return replace(self, pending=list(self.pending), segments=list(self.segments))

    def next_position(self) -> int:
        """The position this stream starts its next unit at."""
        return self.pending[0].position if self.pending else self.next

    def take_unit(self) -> Cursor:
        """The next place to read from (a pending entry, else the next own position), consumed."""
        if self.pending:
            return self.pending.pop(0)
        position = self.next
        self.next += self.stride
        return Cursor(position)

    def to_dict(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "stride": self.stride,
            "next": self.next,
            "pending": [[c.position, c.row] for c in self.pending],
            "cur": None if self.cur is None else [self.cur.position, self.cur.row],
            "segments": [[s.position, s.row, s.offset] for s in self.segments],
            "epoch": self.epoch,
            "num_units": self.num_units,
            "docs": self.docs,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamState:
        cur = d["cur"]
        return cls(
            slot=int(d["slot"]),
            stride=int(d["stride"]),
            next=int(d["next"]),
            pending=[Cursor(int(p), int(r)) for p, r in d["pending"]],
            cur=None if cur is None else Cursor(int(cur[0]), int(cur[1])),
            segments=[Segment(int(p), int(r), int(off)) for p, r, off in d["segments"]],
            epoch=int(d["epoch"]),
            num_units=d["num_units"],
            docs=int(d.get("docs", 0)),
        )


@dataclass
class LoaderState:
    """One dp rank's loader: its streams, the next to yield first, and the layout they belong to.
    ``num_windows``/``shuffle_seed``: a token store's (None for text)."""

    dataset: str
    layout: str
    num_shards: int | None
    dp_rank: int
    dp_world_size: int
    num_workers: int
    streams: list[StreamState]
    num_windows: int | None = None
    shuffle_seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": STATE_VERSION,
            "dataset": self.dataset,
            "layout": self.layout,
            "num_shards": self.num_shards,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "num_workers": self.num_workers,
            "streams": [st.to_dict() for st in self.streams],
        }
        if self.layout == "windows":
            out.update(num_windows=self.num_windows, shuffle_seed=self.shuffle_seed)
        return out

    @classmethod
    def from_dict(cls, d: Any) -> LoaderState:
        if not isinstance(d, dict) or d.get("version") != STATE_VERSION:
            got = d.get("version") if isinstance(d, dict) else type(d).__name__
            raise TitanError(
                f"data loader state has an unknown format (version {got}, expected {STATE_VERSION}); "
                "add 'dataloader' to checkpoint.exclude_from_loading to start the data afresh"
            )
        return cls(
            dataset=d["dataset"],
            layout=d["layout"],
            num_shards=d.get("num_shards"),
            dp_rank=d["dp_rank"],
            dp_world_size=d["dp_world_size"],
            num_workers=d["num_workers"],
            streams=[StreamState.from_dict(st) for st in d["streams"]],
            num_windows=d.get("num_windows"),
            shuffle_seed=d.get("shuffle_seed"),
        )


@dataclass
class MixtureState:
    """A mixture's schedule counter, tokens drawn per source, and each source loader's own state."""

    names: list[str]
    weights: list[float]
    dp_rank: int
    dp_world_size: int
    t: int
    tokens: list[int]
    sources: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": MIXTURE_STATE_VERSION,
            "kind": "mixture",
            "names": list(self.names),
            "weights": list(self.weights),
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "t": self.t,
            "tokens": list(self.tokens),
            "sources": list(self.sources),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MixtureState:
        if d.get("version") != MIXTURE_STATE_VERSION:
            raise TitanError(
                f"data mixture state has an unknown format (version {d.get('version')}, expected "
                f"{MIXTURE_STATE_VERSION}); add 'dataloader' to checkpoint.exclude_from_loading to "
                "start the data afresh"
            )
        return cls(
            names=list(d["names"]),
            weights=list(d["weights"]),
            dp_rank=d["dp_rank"],
            dp_world_size=d["dp_world_size"],
            t=d["t"],
            tokens=list(d["tokens"]),
            sources=list(d["sources"]),
        )


def is_mixture_state(d: Any) -> bool:
    return isinstance(d, dict) and d.get("kind") == "mixture"


class StreamBatch(NamedTuple):
    """What a loader worker yields: one batch of its stream (None on the final item of a finite
    stream, which only carries the state), the worker, its stream's state after the batch, and the
    shards it started reading. A NamedTuple so the DataLoader pins its tensors."""

    inputs: torch.Tensor | None
    labels: torch.Tensor | None
    worker: int
    state: StreamState
    opened: list[int]


@dataclass(frozen=True)
class WorkerError:
    """A TitanError raised in a loader worker, handed over as an item: the DataLoader would re-raise
    it with the worker's traceback folded into the message, losing the one-line form."""

    message: str
    worker: int


class SavedRankStates(Protocol):
    """The loader states a checkpoint saved, one per global rank (the checkpoint manager's object)."""

    def mine(self) -> dict | None:
        """The state this global rank saved; None when the saving run had no such rank."""
        ...

    def all(self) -> list[dict]:
        """Every saved state, in saved-rank order."""
        ...


def one_state_per_dp_rank(states: list[Any]) -> list[Any]:
    """The saved states with one per dp rank: the global ranks of one dp rank (TP, PP, CP) save equal
    loader states. States without a dp rank are kept (the loader reports what they are)."""
    seen: dict[Any, Any] = {}
    for i, st in enumerate(states):
        key = (st.get("dp_world_size"), st.get("dp_rank")) if isinstance(st, dict) and "dp_rank" in st else i
        seen.setdefault(key, st)
    return list(seen.values())


class _Resumable(Protocol):
    dp_rank: int
    dp_world_size: int

    def load_state_dict(self, state_dict: dict) -> None: ...

    def load_resharded(self, states: list[dict]) -> None: ...


def restore_rank_states(loader: _Resumable, saved: SavedRankStates) -> None:
    """Resume ``loader`` from a checkpoint's per-rank states: its own when this global rank saved the
    state of the same dp rank of the same dp degree (the worker count may differ), else the states of
    all old dp ranks, re-dealt (another dp degree, or ranks renumbered by another TP/PP/CP layout)."""
    mine = saved.mine()
    if isinstance(mine, dict) and (mine.get("dp_world_size"), mine.get("dp_rank")) == (
        loader.dp_world_size,
        loader.dp_rank,
    ):
        loader.load_state_dict(mine)
        return
    states = one_state_per_dp_rank(saved.all())
    if states:
        loader.load_resharded(states)
