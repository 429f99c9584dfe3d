"""Document streams, sequence packing and resharding.

Units and positions. A stream (one per DP rank and loader worker) reads *units*: whole shards of
the source when it has at least as many shards as there are streams (layout "shards"), else single
documents of the concatenated stream (layout "documents"; see titan/data/readers.py). Units are
numbered by a global *position* p over the endless repetition of the dataset: p = epoch * U + u
(U units). A stream owns the positions p ≡ slot (mod stride), stride = number of streams; so
within one epoch unit u goes to stream u % stride, and over all epochs every position has exactly
one owner. A stream's whole future is described by a small picklable dict (see
:func:`new_stream_state`):

- ``next``: its next own position; ``pending``: ``[position, row]`` entries to read first, in
  order (left over by a reshard, all < ``next``);
- ``cur``: ``[position, row]`` of the unit being read and the next row in it (None between units):
  a resume reopens that shard and moves to that row;
- ``segments``: ``[position, row, token_offset]`` of the documents in its packing buffer, i.e.
  tokens read but not yet emitted (documents are re-read and re-tokenized on restore, so the
  state stays tiny);
- ``epoch``, ``num_units`` (None until a streaming source's end has been seen), ``docs`` (documents
  read, for logs and benchmarks).

Resharding (:func:`reshard_states`) merges any set of stream states of one layout into a new set
of streams without repeating or skipping a single token: cursor M = max(next); every unit an old
stream still owned below M (its partly read ``cur`` from its row on, its ``pending``, its class
below M) becomes a pending entry, dealt round-robin to the new streams; from M on, new stream s
owns p ≡ s (mod new stride); old buffers move whole, old stream j's to new stream j % new count.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from titan.errors import TitanError
from titan.log import logger

from .readers import DocumentReader, ShardReader
from .sources import DocumentSource

__all__ = ["next_position", "pack_stream", "new_stream_state", "reshard_states", "unread_entries"]

def new_stream_state(slot: int, stride: int, num_units: int | None) -> dict:
    return {
        "slot": slot,
        "stride": stride,
        "next": slot,
        "pending": [],
        "cur": None,
        "segments": [],
        "epoch": 0,
        "num_units": num_units,
        "docs": 0,
    }


def make_reader(source: DocumentSource, layout: str, num_units: int | None):
    return ShardReader(source) if layout == "shards" else DocumentReader(source, num_units)


def _take_unit(state: dict) -> list[int]:
    """The next ``[position, row]`` to read from (a pending entry, else the next own position)."""
    if state["pending"]:
        return list(state["pending"].pop(0))
    pos = state["next"]
    state["next"] += state["stride"]
    return [pos, 0]


def next_position(state: dict) -> int:
    """The position this stream starts its next unit at."""
    return state["pending"][0][0] if state["pending"] else state["next"]


def pack_stream(
    source: DocumentSource,
    tokenizer,
    state: dict,
    *,
    layout: str,
    seq_len: int,
    batch_size: int,
    infinite: bool,
    label: str = "",
) -> Iterator[tuple[torch.Tensor | None, dict, list[int]]]:
    """Yield ``(windows [batch_size, seq_len + 1], state after this batch, units opened)`` from one
    stream; ``units opened`` lists what the reader started reading since the previous item.

    In finite mode the stream ends at the first position of epoch 1; it then yields one last
    ``(None, final state, ...)`` so the caller's state shows every document read (leftover tokens
    stay in ``segments``, they are not emitted as a partial batch).
    """
    state = copy.deepcopy(state)
    reader = make_reader(source, layout, state["num_units"])
    need = batch_size * (seq_len + 1)

    def tokens_of(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(text, bos=True, eos=True), dtype=torch.long)

    def opened() -> list[int]:
        out, reader.opened = reader.opened, []
        return out

    def finish():
        state["num_units"] = reader.num_units
        return None, state, opened()

    # restore the packing buffer: [position, row, offset, tokens]
    buf: list[list] = []
    for pos, row, offset in state["segments"]:
        _, text = reader.read(pos, row)
        if text is None:
            raise TitanError(f"dataset {source.name!r}{label}: document {row} of unit {pos} named by the data "
                             "loader state is gone: the dataset changed since the checkpoint")
        buf.append([pos, row, offset, tokens_of(text)])
    buffered = sum(len(t) - off for _, _, off, t in buf)
    empty_run = 0  # units in a row that held no document

    while True:
        while buffered < need:
            if state["cur"] is None:
                if not infinite and reader.locate(next_position(state))[0] > 0:
                    yield finish()
                    return
                state["cur"] = _take_unit(state)
            pos, row = state["cur"]
            epoch, text = reader.read(pos, row)
            if not infinite and epoch > 0:  # N was learned by this very read
                yield finish()
                return
            if text is None:  # past the unit's last row
                state["cur"] = None
                empty_run = empty_run + 1 if row == 0 else 0
                if empty_run > (reader.num_units or 0) + state["stride"]:
                    raise TitanError(f"dataset {source.name!r}{label}: the shards this stream reads hold no "
                                     "documents; remove the empty files or use fewer dp ranks x workers")
                continue
            empty_run = 0
            if epoch > state["epoch"]:
                state["epoch"] = epoch
                logger.warning(
                    f"dataset {source.name!r}{label}: shard exhausted, re-looping over it (epoch {epoch})"
                )
            toks = tokens_of(text)
            state["cur"] = None if reader.single_row else [pos, row + 1]
            state["docs"] += 1
            buf.append([pos, row, 0, toks])
            state["segments"].append([pos, row, 0])
            buffered += len(toks)
        # take `need` tokens from the front of the buffer
        parts, take = [], need
        while take > 0:
            seg = buf[0]
            n = min(take, len(seg[3]) - seg[2])
            parts.append(seg[3][seg[2] : seg[2] + n])
            seg[2] += n
            take -= n
            if seg[2] == len(seg[3]):
                buf.pop(0)
        buffered -= need
        state["segments"] = [[p, r, off] for p, r, off, _ in buf]
        state["num_units"] = reader.num_units
        yield torch.cat(parts).view(batch_size, seq_len + 1), copy.deepcopy(state), opened()


def unread_entries(state: dict, upto: int) -> list[list[int]]:
    """``[position, row]`` of what this stream still owns below ``upto``: its partly read unit, its
    pending entries, then its own positions from ``next``."""
    cur = [list(state["cur"])] if state["cur"] is not None else []
    return cur + [list(e) for e in state["pending"]] + [[p, 0] for p in range(state["next"], upto, state["stride"])]


def reshard_states(old: list[dict], new_slots: list[int], new_stride: int) -> list[dict]:
    """Re-deal the unread future of the ``old`` streams to new streams ``new_slots``.

    Exact when ``old`` and ``new_slots`` cover the same set of positions from the cursor on: all
    streams of a layout (DP world size changed), or all of one rank's streams when only that
    rank's worker count changed (slots r + W*k, stride W*K). Deterministic: every rank computes
    the same global plan and keeps its own part.
    """
    if not old:
        raise TitanError("reshard: no old data-loader states given")
    old = sorted(old, key=lambda s: s["slot"])
    cursor = max(s["next"] for s in old)
    pending = sorted(e for s in old for e in unread_entries(s, cursor))
    known = [s["num_units"] for s in old if s["num_units"] is not None]
    epoch = max(s["epoch"] for s in old)
    docs = sum(s.get("docs", 0) for s in old)
    new = []
    for i, s in enumerate(new_slots):
        st = new_stream_state(s, new_stride, known[0] if known else None)
        st["next"] = cursor + (s - cursor) % new_stride  # smallest p >= cursor with p ≡ s
        st["epoch"] = epoch
        st["docs"] = docs // len(new_slots) + (i < docs % len(new_slots))
        new.append(st)
    for j, e in enumerate(pending):
        new[j % len(new)]["pending"].append(e)
    for j, s in enumerate(old):
        new[j % len(new)]["segments"].extend(copy.deepcopy(s["segments"]))
    partial = sum(1 for e in pending if e[1] > 0)
    if pending or partial:
        logger.info(f"data loader re-deal: {len(pending)} unread unit(s) below position {cursor} "
                    f"({partial} partly read, continued from their row) go to {len(new)} new stream(s); "
                    "nothing is re-read or skipped")
    return new
