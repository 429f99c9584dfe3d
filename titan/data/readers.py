"""Readers fetch the documents of one loader stream by (unit position, row).

Two layouts (chosen by the loader, see titan/data/packing.py):

- ``ShardReader`` ("shards"): a unit is one shard of the source; position p is shard p mod S of
  epoch p // S, and row r its r-th document. Reading continues an open shard; reaching row r of a
  shard that is not open reads that shard only (a resume costs at most one shard).
- ``DocumentReader`` ("documents"): a unit is one document of the whole concatenated stream and
  has one row. Reaching document i of a streaming source parses the i documents before it.

``opened`` lists what a reader started reading since the caller last emptied it: shard indices,
or -1 for a pass over the whole stream (read statistics, see TitanDataLoader.read_stats).
"""

from __future__ import annotations

from collections.abc import Iterator

from titan.errors import TitanError

from .sources import DocumentSource, SkipProgress

__all__ = ["DocumentReader", "ShardReader"]


class ShardReader:
    single_row = False

    def __init__(self, source: DocumentSource) -> None:
        self.source = source
        self.num_units = source.num_shards
        self._open: tuple[int, int, Iterator[str]] | None = None  # (shard, next row, rows)
        self.opened: list[int] = []

    def locate(self, pos: int) -> tuple[int, int]:
        return divmod(pos, self.num_units)

    def read(self, pos: int, row: int) -> tuple[int, str | None]:
        """(epoch, text of row ``row`` of the unit at ``pos``), text None past the shard's end."""
        epoch, shard = divmod(pos, self.num_units)
        if self._open is None or self._open[:2] != (shard, row):
            self._open = (shard, row, iter(self.source.iter_shard(shard, row)))
            self.opened.append(shard)
        it = self._open[2]
        text = next(it, None)
        self._open = None if text is None else (shard, row + 1, it)
        return epoch, text


class DocumentReader:
    """Fetches documents by position, keeping a forward pass open over streaming sources."""

    single_row = True

    def __init__(self, source: DocumentSource, num_docs: int | None) -> None:
        self.source = source
        self.num_units = num_docs if num_docs is not None else source.num_docs
        # open pass over a streaming source: (epoch, first index, next index, iterator)
        self._pass: tuple[int, int, int, Iterator[str]] | None = None
        self.opened: list[int] = []

    def _count(self) -> int:
        n = sum(1 for _ in self.source.iter_docs(0))
        if n == 0:
            raise TitanError(f"dataset {self.source.name!r} is empty (no documents)")
        return n

    def _get(self, epoch: int, index: int) -> str | None:
        """The document at (epoch, index), or None when index is past the end (N is then known)."""
        if self.source.seekable:
            assert self.num_units is not None, "a seekable source knows its document count"
            return self.source.get(index) if index < self.num_units else None
        if self._pass is None or self._pass[0] != epoch or self._pass[2] > index:
            self._pass = (epoch, index, index, self.source.iter_docs(index))
            self.opened.append(-1)
        _, start, at, it = self._pass
        first = at
        progress = (
            SkipProgress(f"dataset {self.source.name!r}: reading up to document {index}", index - first)
            if index - first > 10_000
            else None
        )
        try:
            while at < index:  # documents of other streams: parsed, not tokenized
                next(it)
                at += 1
                if progress and (at - first) % 4096 == 0:
                    progress.update(at - first)
            text = next(it)
        except StopIteration:
            self._pass = None
            # a pass that yielded anything ends exactly at N; one that started past the end
            # only tells N <= start, so count
            self.num_units = at if at > start else self._count()
            return None
        if progress:
            progress.finish()
        self._pass = (epoch, start, index + 1, it)
        return text

    def locate(self, pos: int) -> tuple[int, int]:
        n = self.num_units
        if n == 0:
            raise TitanError(f"dataset {self.source.name!r} is empty (no documents)")
        return divmod(pos, n) if n is not None else (0, pos)

    def read(self, pos: int, row: int = 0) -> tuple[int, str | None]:
        """(epoch, text) of the document at position ``pos`` (a unit has only row 0)."""
        if row > 0:
            return self.locate(pos)[0], None
        while True:
            epoch, index = self.locate(pos)
            text = self._get(epoch, index)
            if text is not None:
                return epoch, text
            if self.num_units is None:  # pragma: no cover - _get always learns N
                raise AssertionError("document count unknown after end of pass")
