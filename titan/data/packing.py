"""Document streams, sequence packing and resharding.

Positions. Document reads are numbered by a global *position* p over the endless repetition of
the dataset: p = epoch * N + index (N documents). A *stream* (one per DP rank and loader worker)
owns the positions p ≡ slot (mod stride), stride = number of streams; so within one epoch the
documents are dealt i -> i % stride, and over all epochs every position has exactly one owner.
A stream's whole future is described by a small picklable dict (see :func:`new_stream_state`):

- ``next``: its next own position; ``pending``: sorted extra positions to read first (left over
  by a reshard, all < ``next``);
- ``segments``: ``[position, token_offset]`` of the documents in its packing buffer, i.e. tokens
  read but not yet emitted (documents are re-tokenized on restore, so the state stays tiny);
- ``epoch``, ``num_docs`` (None until a streaming source's end has been seen).

Resharding (:func:`reshard_states`) merges any set of stream states into a new layout without
repeating or skipping a single token: cursor M = max(next); every position an old stream still
owned below M becomes pending (dealt round-robin to the new streams); from M on, new stream s owns
p ≡ s (mod new stride); old buffers move whole, old stream j's to new stream j % new count.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from titan.errors import TitanError
from titan.tools.logging import logger

from .datasets import DocumentSource

__all__ = ["DocumentReader", "pack_stream", "new_stream_state", "reshard_states", "unread_positions"]


def new_stream_state(slot: int, stride: int, num_docs: int | None) -> dict:
    return {
        "slot": slot,
        "stride": stride,
        "next": slot,
        "pending": [],
        "segments": [],
        "epoch": 0,
        "num_docs": num_docs,
    }


class DocumentReader:
    """Fetches documents by position, keeping a forward pass open over streaming sources."""

    def __init__(self, source: DocumentSource, num_docs: int | None) -> None:
        self.source = source
        self.num_docs = num_docs if num_docs is not None else source.num_docs
        # open pass over a streaming source: (epoch, first index, next index, iterator)
        self._pass: tuple[int, int, int, Iterator[str]] | None = None

    def _count(self) -> int:
        n = sum(1 for _ in self.source.iter_docs(0))
        if n == 0:
            raise TitanError(f"dataset {self.source.name!r} is empty (no documents)")
        return n

    def _get(self, epoch: int, index: int) -> str | None:
        """The document at (epoch, index), or None when index is past the end (N is then known)."""
        if self.source.seekable:
            return self.source.get(index) if index < self.num_docs else None
        if self._pass is None or self._pass[0] != epoch or self._pass[2] > index:
            self._pass = (epoch, index, index, self.source.iter_docs(index))
        _, start, at, it = self._pass
        try:
            while at < index:  # documents of other streams: parsed, not tokenized
                next(it)
                at += 1
            text = next(it)
        except StopIteration:
            self._pass = None
            # a pass that yielded anything ends exactly at N; one that started past the end
            # only tells N <= start, so count
            self.num_docs = at if at > start else self._count()
            return None
        self._pass = (epoch, start, index + 1, it)
        return text

    def locate(self, pos: int) -> tuple[int, int]:
        n = self.num_docs
        if n == 0:
            raise TitanError(f"dataset {self.source.name!r} is empty (no documents)")
        return divmod(pos, n) if n is not None else (0, pos)

    def read(self, pos: int) -> tuple[int, str]:
        """(epoch, text) of the document at position ``pos``."""
        while True:
            epoch, index = self.locate(pos)
            text = self._get(epoch, index)
            if text is not None:
                return epoch, text
            if self.num_docs is None:  # pragma: no cover - _get always learns N
                raise AssertionError("document count unknown after end of pass")


def _next_position(state: dict) -> int:
    return state["pending"][0] if state["pending"] else state["next"]


def _advance(state: dict) -> None:
    if state["pending"]:
        state["pending"].pop(0)
    else:
        state["next"] += state["stride"]


def pack_stream(
    source: DocumentSource,
    tokenizer,
    state: dict,
    *,
    seq_len: int,
    batch_size: int,
    infinite: bool,
    label: str = "",
) -> Iterator[tuple[torch.Tensor | None, dict]]:
    """Yield ``(windows [batch_size, seq_len + 1], state after this batch)`` from one stream.

    In finite mode the stream ends at the first position of epoch 1; it then yields one last
    ``(None, final state)`` so the caller's state shows every document read (leftover tokens stay
    in ``segments``, they are not emitted as a partial batch).
    """
    state = copy.deepcopy(state)
    reader = DocumentReader(source, state["num_docs"])
    need = batch_size * (seq_len + 1)

    def tokens_of(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer.encode(text, bos=True, eos=True), dtype=torch.long)

    # restore the packing buffer: [position, offset, tokens]
    buf: list[list] = []
    for pos, offset in state["segments"]:
        _, text = reader.read(pos)
        buf.append([pos, offset, tokens_of(text)])
    buffered = sum(len(t) - off for _, off, t in buf)

    while True:
        while buffered < need:
            pos = _next_position(state)
            epoch, index = reader.locate(pos)
            if not infinite and epoch > 0:
                state["num_docs"] = reader.num_docs
                yield None, state
                return
            epoch, text = reader.read(pos)
            if not infinite and epoch > 0:  # N was learned by this very read
                state["num_docs"] = reader.num_docs
                yield None, state
                return
            if epoch > state["epoch"]:
                state["epoch"] = epoch
                logger.warning(
                    f"dataset {source.name!r}{label}: shard exhausted, re-looping over it (epoch {epoch})"
                )
            toks = tokens_of(text)
            _advance(state)
            buf.append([pos, 0, toks])
            state["segments"].append([pos, 0])
            buffered += len(toks)
        # take `need` tokens from the front of the buffer
        parts, take = [], need
        while take > 0:
            seg = buf[0]
            n = min(take, len(seg[2]) - seg[1])
            parts.append(seg[2][seg[1] : seg[1] + n])
            seg[1] += n
            take -= n
            if seg[1] == len(seg[2]):
                buf.pop(0)
        buffered -= need
        state["segments"] = [[p, off] for p, off, _ in buf]
        state["num_docs"] = reader.num_docs
        yield torch.cat(parts).view(batch_size, seq_len + 1), copy.deepcopy(state)


def unread_positions(state: dict, upto: int) -> list[int]:
    """Positions this stream still owns below ``upto`` (pending, then its class from ``next``)."""
    return list(state["pending"]) + list(range(state["next"], upto, state["stride"]))


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
    pending = sorted(p for s in old for p in unread_positions(s, cursor))
    known = [s["num_docs"] for s in old if s["num_docs"] is not None]
    epoch = max(s["epoch"] for s in old)
    new = []
    for s in new_slots:
        st = new_stream_state(s, new_stride, known[0] if known else None)
        st["next"] = cursor + (s - cursor) % new_stride  # smallest p >= cursor with p ≡ s
        st["epoch"] = epoch
        new.append(st)
    for j, p in enumerate(pending):
        new[j % len(new)]["pending"].append(p)
    for j, s in enumerate(old):
        new[j % len(new)]["segments"].extend(copy.deepcopy(s["segments"]))
    return new
