"""Document streams, sequence packing and resharding.

Units and positions. A stream (one per DP rank and loader worker) reads *units*: whole shards of
the source when it has at least as many shards as there are streams (layout "shards"), else single
documents of the concatenated stream (layout "documents"; see titan/data/readers.py). Units are
numbered by a global *position* p over the endless repetition of the dataset: p = epoch * U + u
(U units). A stream owns the positions p ≡ slot (mod stride), stride = number of streams; so
within one epoch unit u goes to stream u % stride, and over all epochs every position has exactly
one owner. A stream's whole future is described by a small ``StreamState``
(titan/data/state.py):

- ``next``: its next own position; ``pending``: cursors (position, row) to read first, in
  order (left over by a reshard, all < ``next``);
- ``cur``: the cursor of the unit being read and the next row in it (None between units):
  a resume reopens that shard and moves to that row;
- ``segments``: (position, row, token_offset) of the documents in its packing buffer, i.e.
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

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from titan.errors import TitanError
from titan.log import logger

from .readers import DocumentReader, ShardReader
from .sources import DocumentSource
from .state import Cursor, Segment, StreamState

__all__ = ["PackedBatch", "choose_layout", "pack_stream", "reshard_states", "unread_entries"]


def choose_layout(num_shards: int, num_streams: int) -> str:
    """Whole shards per stream when every stream gets at least one, else documents."""
    return "shards" if num_shards > 1 and num_shards >= num_streams else "documents"


class PackedBatch(NamedTuple):
    """One batch of a stream: ``windows`` [batch_size, seq_len + 1] (None on the final item of a
    finite stream), the stream's state after it, and the units the reader started since the last item."""

    windows: torch.Tensor | None
    state: StreamState
    opened: list[int]


@dataclass
class _Buffered:
    """A document in the packing buffer: where it was read, its tokens, how many are emitted."""

    position: int
    row: int
    offset: int
    tokens: torch.Tensor


def make_reader(source: DocumentSource, layout: str, num_units: int | None) -> ShardReader | DocumentReader:
    return ShardReader(source) if layout == "shards" else DocumentReader(source, num_units)


def pack_stream(
    source: DocumentSource,
    tokenizer,
    state: StreamState,
    *,
    layout: str,
    seq_len: int,
    batch_size: int,
    infinite: bool,
    label: str = "",
) -> Iterator[PackedBatch]:
    """Yield the batches of one stream (see PackedBatch).

    In finite mode the stream ends at the first position of epoch 1; it then yields one last
    item with no windows and the final state, so the caller's state shows every document read
    (leftover tokens stay in ``segments``, they are not emitted as a partial batch).
    """
    state = state.clone()
    reader = make_reader(source, layout, state.num_units)
    need = batch_size * (seq_len + 1)

    def tokens_of(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(text, bos=True, eos=True), dtype=torch.long)

    def opened() -> list[int]:
        out, reader.opened = reader.opened, []
        return out

    def finish() -> PackedBatch:
        state.num_units = reader.num_units
        state.segments = [Segment(b.position, b.row, b.offset) for b in buf]
        return PackedBatch(None, state, opened())

    buf: list[_Buffered] = []
    for seg in state.segments:
        _, text = reader.read(seg.position, seg.row)
        if text is None:
            raise TitanError(
                f"dataset {source.name!r}{label}: document {seg.row} of unit {seg.position} named by "
                "the data loader state is gone: the dataset changed since the checkpoint"
            )
        buf.append(_Buffered(seg.position, seg.row, seg.offset, tokens_of(text)))
    buffered = sum(len(b.tokens) - b.offset for b in buf)
    empty_run = 0  # units in a row that held no document

    while True:
        while buffered < need:
            if state.cur is None:
                if not infinite and reader.locate(state.next_position())[0] > 0:
                    yield finish()
                    return
                state.cur = state.take_unit()
            pos, row = state.cur.position, state.cur.row
            epoch, text = reader.read(pos, row)
            if not infinite and epoch > 0:  # N was learned by this very read
                yield finish()
                return
            if text is None:  # past the unit's last row
                state.cur = None
                empty_run = empty_run + 1 if row == 0 else 0
                if empty_run > (reader.num_units or 0) + state.stride:
                    raise TitanError(
                        f"dataset {source.name!r}{label}: the shards this stream reads hold no "
                        "documents; remove the empty files or use fewer dp ranks x workers"
                    )
                continue
            empty_run = 0
            if epoch > state.epoch:  # the loader's main process says so (epochs.py)
                state.epoch = epoch
            toks = tokens_of(text)
            state.cur = None if reader.single_row else Cursor(pos, row + 1)
            state.docs += 1
            buf.append(_Buffered(pos, row, 0, toks))
            buffered += len(toks)
        # take `need` tokens from the front of the buffer
        parts, take = [], need
        while take > 0:
            first = buf[0]
            n = min(take, len(first.tokens) - first.offset)
            parts.append(first.tokens[first.offset : first.offset + n])
            first.offset += n
            take -= n
            if first.offset == len(first.tokens):
                buf.pop(0)
        buffered -= need
        state.segments = [Segment(b.position, b.row, b.offset) for b in buf]
        state.num_units = reader.num_units
        yield PackedBatch(torch.cat(parts).view(batch_size, seq_len + 1), state.clone(), opened())


def unread_entries(state: StreamState, upto: int) -> list[Cursor]:
    """What this stream still owns below ``upto``: its partly read unit, its pending entries, then
    its own positions from ``next``."""
    cur = [state.cur] if state.cur is not None else []
    return cur + list(state.pending) + [Cursor(p) for p in range(state.next, upto, state.stride)]


def reshard_states(old: list[StreamState], new_slots: list[int], new_stride: int) -> list[StreamState]:
    """Re-deal the unread future of the ``old`` streams to new streams ``new_slots``.

    Exact when ``old`` and ``new_slots`` cover the same set of positions from the cursor on: all
    streams of a layout (DP world size changed), or all of one rank's streams when only that
    rank's worker count changed (slots r + W*k, stride W*K). Deterministic: every rank computes
    the same global plan and keeps its own part.
    """
    if not old:
        raise TitanError("reshard: no old data-loader states given")
    old = sorted(old, key=lambda s: s.slot)
    cursor = max(s.next for s in old)
    pending = sorted((e for s in old for e in unread_entries(s, cursor)), key=lambda c: (c.position, c.row))
    known = [s.num_units for s in old if s.num_units is not None]
    epoch = max(s.epoch for s in old)
    docs = sum(s.docs for s in old)
    new = []
    for i, slot in enumerate(new_slots):
        st = StreamState.new(slot, new_stride, known[0] if known else None)
        st.next = cursor + (slot - cursor) % new_stride  # smallest p >= cursor with p ≡ slot
        st.epoch = epoch
        st.docs = docs // len(new_slots) + (i < docs % len(new_slots))
        new.append(st)
    for j, e in enumerate(pending):
        new[j % len(new)].pending.append(e)
    for j, s in enumerate(old):
        new[j % len(new)].segments.extend(s.segments)
    partial = sum(1 for e in pending if e.row > 0)
    if pending or partial:
        logger.info(
            f"data loader re-deal: {len(pending)} unread unit(s) below position {cursor} "
            f"({partial} partly read, continued from their row) go to {len(new)} new stream(s); "
            "nothing is re-read or skipped"
        )
    return new
