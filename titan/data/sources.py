"""Document sources: ordered, re-iterable sequences of texts, optionally split into *shards*.

A source numbers its documents 0..N-1 (``iter_docs``); a sharded source (several files, or a hub
dataset with ``n_shards``) can also read shard j on its own from any row (``iter_shard``), which
is what lets the loader give whole shards to ranks and resume inside one shard
(titan/data/packing.py). The registry and local-path resolution live in titan/data/datasets.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from titan.errors import TitanError
from titan.log import logger

__all__ = ["DocumentSource", "HFStreamSource", "ListSource", "SkipProgress"]

_READ_BATCH = 64  # rows per read from a `datasets` stream


class SkipProgress:
    """Logs a long skip (rows read only to reach a position) every ``every`` seconds, so a resume
    that seeks far into a shard shows it is moving; silent when the skip is quick."""

    def __init__(self, what: str, total: int, every: float = 5.0) -> None:
        self.what, self.total, self.every = what, total, every
        self.start = self.last = time.monotonic()
        self.logged = False

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last, self.logged = now, True
            logger.info(f"{self.what}: skipped {done:,} of {self.total:,} rows ({now - self.start:.0f} s)")

    def finish(self) -> None:
        if self.logged:
            logger.info(f"{self.what}: reached row {self.total:,} in {time.monotonic() - self.start:.0f} s")


class DocumentSource:
    """An ordered, re-iterable sequence of text documents.

    ``num_docs`` is the count when known up front (None for streams: the loader learns it when a
    pass ends). ``iter_docs(start)`` yields the texts of documents start, start+1, ...
    ``seekable`` sources also answer ``get(i)`` in O(1). ``num_shards`` > 1: the documents are the
    concatenation of shards 0..num_shards-1 and ``iter_shard(j, row)`` reads shard j from ``row``.
    """

    name: str = ""
    seekable: bool = False

    @property
    def num_docs(self) -> int | None:
        return None

    @property
    def num_shards(self) -> int:
        return 1

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        raise NotImplementedError

    def get(self, index: int) -> str:
        raise NotImplementedError

    def iter_shard(self, shard: int, row: int = 0) -> Iterator[str]:
        if shard != 0:
            raise IndexError(f"{self.name!r} has one shard, asked for shard {shard}")
        return self.iter_docs(row)

    def shard_name(self, shard: int) -> str:
        return f"{self.name} shard {shard}/{self.num_shards}"

    def shard_bytes(self, shard: int) -> int | None:
        """Size on disk of the shard (None when not a local file); for the loader's read statistics."""
        return None


class ListSource(DocumentSource):
    """Documents held in memory (the embedded corpus, tests)."""

    seekable = True

    def __init__(self, name: str, docs: list[str]) -> None:
        self.name = name
        self.docs = list(docs)

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        for i in range(start, len(self.docs)):
            yield self.docs[i]

    def get(self, index: int) -> str:
        return self.docs[index]


def _not_utf8(name: str, e: UnicodeDecodeError) -> TitanError:
    return TitanError(
        f"dataset {name!r} is not UTF-8 text ({e.reason} at byte {e.start}); convert it, e.g. iconv -f latin1 -t utf-8"
    )


class HFStreamSource(DocumentSource):
    """A streaming ``datasets.IterableDataset``; document i is its i-th row's ``text_field``.

    Its shards are the dataset's own (``n_shards``: one per file for local data and for hub
    datasets such as allenai/c4); shard j is read through ``IterableDataset.shard``. Reaching a
    row inside a shard re-reads (parses, does not tokenize) the rows before it in that shard.
    ``shard_files``, when given, names the file behind each shard (errors, statistics): a Path, or
    a URL string for streamed files.
    ``parquet_files`` (local paths or URLs such as hf://...), when the shards are parquet files:
    reaching a row skips the row groups before it unread (a resume reads one row group's rows, not
    a whole file's); the rows are the same as the stream's.
    """

    def __init__(
        self, name: str, dataset, text_field: str, shard_files: list | None = None, parquet_files: list | None = None
    ) -> None:
        self.name = name
        self.dataset = dataset
        self.text_field = text_field
        self.shard_files = shard_files
        self.parquet_files = parquet_files

    @property
    def num_shards(self) -> int:
        return max(1, int(getattr(self.dataset, "n_shards", 1) or 1))

    def shard_name(self, shard: int) -> str:
        if self.shard_files and len(self.shard_files) == self.num_shards:
            return str(self.shard_files[shard])
        return super().shard_name(shard)

    def shard_bytes(self, shard: int) -> int | None:
        if self.shard_files and len(self.shard_files) == self.num_shards:
            file = self.shard_files[shard]
            return file.stat().st_size if isinstance(file, Path) else None  # a URL: not on this disk
        return None

    def _rows(self, ds, start: int, where: str, parsed: list[int] | None = None) -> Iterator[str]:
        """The texts of ``ds`` from row ``start``; ``parsed[0]``: the rows it held, once exhausted."""
        # .iter(batch_size) rather than iter(ds): inside a DataLoader worker the latter hands each
        # worker only some of the files, which would break the document numbering
        progress = SkipProgress(f"dataset {self.name!r}: seeking in {where}", start) if start else None
        seen = 0
        try:
            for batch in ds.iter(batch_size=_READ_BATCH):
                column = batch[self.text_field]
                if seen + len(column) <= start:
                    seen += len(column)
                    if progress:
                        progress.update(seen)
                    continue
                skip, seen = max(0, start - seen), seen + len(column)
                if progress:
                    progress.finish()
                    progress = None
                yield from self._texts(column[skip:])
            if parsed is not None:
                parsed[0] = seen
        except UnicodeDecodeError as e:
            raise _not_utf8(self.name, e) from None
        except (TitanError, GeneratorExit):
            raise
        except Exception as e:  # pyarrow parse errors, truncated files: one line naming the shard
            first = str(e).splitlines()[0] if str(e) else ""
            raise TitanError(f"cannot read dataset {self.name!r} ({where}): {type(e).__name__}: {first}") from None

    def _named(self) -> bool:
        return bool(self.shard_files) and len(self.shard_files or ()) == self.num_shards

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        if not self._named():
            return self._rows(self.dataset, start, "the whole stream")
        return self._file_by_file(start)

    def _file_by_file(self, start: int) -> Iterator[str]:
        """The whole stream, shard after shard (the same rows in the same order), so that a file
        that cannot be read is named in the error."""
        for shard in range(self.num_shards):
            parsed = [0]
            yield from self._rows(self._shard(shard), start, self.shard_name(shard), parsed)
            start = max(0, start - parsed[0])

    def _shard(self, shard: int):
        if self.num_shards == 1:
            return self.dataset
        return self.dataset.shard(num_shards=self.num_shards, index=shard, contiguous=True)

    def _parquet_rows(self, file: str, start: int) -> Iterator[str]:
        import fsspec
        import pyarrow.parquet as pq

        try:
            with fsspec.open(file, "rb") as fh:  # a local path, or a URL such as hf://datasets/...
                pf = pq.ParquetFile(fh)
                groups = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
                first = group = 0
                while group < len(groups) and first + groups[group] <= start:
                    first += groups[group]
                    group += 1
                skip = start - first
                batches = pf.iter_batches(
                    batch_size=_READ_BATCH, row_groups=range(group, len(groups)), columns=[self.text_field]
                )
                for batch in batches:
                    column = batch.column(0).to_pylist()
                    if skip >= len(column):
                        skip -= len(column)
                        continue
                    yield from self._texts(column[skip:])
                    skip = 0
        except (TitanError, GeneratorExit):
            raise
        except Exception as e:  # a truncated file, a lost connection: one line naming the file
            first_line = str(e).splitlines()[0] if str(e) else ""
            raise TitanError(f"cannot read dataset {self.name!r} ({file}): {type(e).__name__}: {first_line}") from None

    def iter_shard(self, shard: int, row: int = 0) -> Iterator[str]:
        if row > 0 and self.parquet_files and len(self.parquet_files) == self.num_shards:
            return self._parquet_rows(str(self.parquet_files[shard]), row)
        return self._rows(self._shard(shard), row, self.shard_name(shard))

    def _texts(self, column: list) -> Iterator[str]:
        for text in column:
            if not isinstance(text, str):
                raise TitanError(
                    f"dataset {self.name!r}: column {self.text_field!r} holds {type(text).__name__}, "
                    "expected str; set training.dataset_text_field to a text column"
                )
            yield text

    def validate(self) -> None:
        """Fail early, with one clear line, on an empty dataset or a missing text column (reads the
        first row: a file that cannot be read there is named)."""
        where = f" ({self.shard_name(0)})" if self._named() else ""
        try:
            first = next(iter(self.dataset))
        except StopIteration:
            raise TitanError(f"dataset {self.name!r} is empty (no rows)") from None
        except UnicodeDecodeError as e:
            raise _not_utf8(self.name, e) from None
        except Exception as e:
            first_line = str(e).splitlines()[0] if str(e) else ""
            raise TitanError(f"cannot read dataset {self.name!r}{where}: {type(e).__name__}: {first_line}") from None
        if self.text_field not in first:
            raise TitanError(
                f"dataset {self.name!r} has no column {self.text_field!r} "
                f"(training.dataset_text_field); available columns: {sorted(first)}"
            )


def check_parquet_footers(source: DocumentSource) -> None:
    """Open the footer (schema and row groups) of every local parquet file of ``source``: a
    truncated or overwritten file fails here, named, in milliseconds per file. Data pages are read
    only by training; a corrupt page is named by the error of the rank that reads it."""
    files = getattr(source, "parquet_files", None) or []
    for file in files:
        if "://" in file:
            continue  # streamed: reading its footer is a network request per file
        import pyarrow.parquet as pq

        try:
            pq.ParquetFile(file).metadata  # noqa: B018 - reading it is the check
        except Exception as e:
            first_line = str(e).splitlines()[0] if str(e) else ""
            raise TitanError(
                f"cannot read dataset {getattr(source, 'name', '?')!r} ({file}): {type(e).__name__}: {first_line}"
            ) from None
