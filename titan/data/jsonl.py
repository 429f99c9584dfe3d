"""JSON-lines files (.jsonl, .jsonl.gz, line-delimited .json.gz such as allenai/c4's shards) read
line by line, so a broken line can be named (file:line) and, if the config says so
(training.dataset_bad_lines = "skip"), dropped with a count instead of stopping.

Every file is a shard. Document i is the i-th *good* row over the files in order, and row r of
shard j is the r-th good row of file j: the numbering (hence sharding and resume) stays
deterministic whether or not lines are skipped. A truncated or corrupt .gz file stops with one
line naming it.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from titan.config.choices import BadLines, choices
from titan.errors import TitanError
from titan.log import logger

from .sources import DocumentSource, SkipProgress

_SHOW = 5
SCAN_LINES = 1000  # rows checked at start-up (validate); later broken lines are met while training
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def _open(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def is_json_lines(path: Path) -> bool:
    """True when the file's first non-blank byte opens an object (JSON lines), not an array."""
    try:
        with _open(path) as fh:
            head = fh.read(4096).lstrip()
    except _GZIP_ERRORS + (OSError,) as e:
        raise TitanError(f"dataset file {path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    return head[:1] in (b"{", b"")


class JsonlSource(DocumentSource):
    def __init__(self, name: str, files: list[Path], text_field: str, bad_lines: str = "fail") -> None:
        if bad_lines not in choices(BadLines):
            raise TitanError(
                f"config key 'training.dataset_bad_lines' got {bad_lines!r}; valid: {', '.join(choices(BadLines))}"
            )
        self.name, self.files, self.text_field, self.bad_lines = name, [Path(f) for f in files], text_field, bad_lines
        self.skipped = 0

    @property
    def num_shards(self) -> int:
        return len(self.files)

    def shard_name(self, shard: int) -> str:
        return str(self.files[shard])

    def shard_bytes(self, shard: int) -> int:
        return self.files[shard].stat().st_size

    def _bad(self, where: str, why: str) -> None:
        if self.bad_lines == "fail":
            raise TitanError(f'{where}: {why}; fix the line or set training.dataset_bad_lines = "skip"')
        self.skipped += 1
        if self.skipped <= _SHOW:
            logger.warning(
                f"{where}: {why}; skipped {self.skipped} broken line(s) so far (training.dataset_bad_lines = skip)"
            )

    def _file_rows(self, f: Path) -> Iterator[tuple[int, dict]]:
        """(line number, row) of every good row of one file."""
        lineno = 0
        try:
            with _open(f) as fh:
                for lineno, raw in enumerate(fh, 1):
                    if not raw.strip():
                        continue
                    where = f"{f}:{lineno}"
                    try:
                        row = json.loads(raw.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        self._bad(where, f"not UTF-8 ({e.reason} at byte {e.start})")
                        continue
                    except ValueError as e:
                        self._bad(where, f"not valid JSON ({e})")
                        continue
                    if not isinstance(row, dict):
                        self._bad(where, f"a JSON {type(row).__name__}, not an object")
                        continue
                    yield lineno, row
        except _GZIP_ERRORS as e:
            raise TitanError(
                f"dataset file {f} is truncated or corrupt after line {lineno} "
                f"({type(e).__name__}: {e}); download it again"
            ) from None

    def _text(self, row: dict, where: str) -> str:
        text = row.get(self.text_field)
        if not isinstance(text, str):
            raise TitanError(
                f"dataset {self.name!r}: {where} has no text in column {self.text_field!r} "
                f"(got {type(text).__name__}); set training.dataset_text_field to a text column"
            )
        return text

    def iter_shard(self, shard: int, row: int = 0) -> Iterator[str]:
        f = self.files[shard]
        progress = SkipProgress(f"dataset {self.name!r}: seeking in {f}", row) if row else None
        for i, (lineno, r) in enumerate(self._file_rows(f)):
            if i < row:
                if progress and i % 4096 == 0:
                    progress.update(i)
                continue
            if progress:
                progress.finish()
                progress = None
            yield self._text(r, f"{f}:{lineno}")

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        self.skipped = 0
        i = 0
        for f in self.files:
            for lineno, r in self._file_rows(f):
                if i >= start:
                    yield self._text(r, f"{f}:{lineno}")
                i += 1

    def validate(self) -> None:
        """Fail early on an empty first file, a missing text column, or (in "fail" mode) a broken
        line among the first SCAN_LINES rows."""
        first = None
        for f in self.files:
            rows = self._file_rows(f)
            first = next(rows, None)
            for _ in zip(range(SCAN_LINES), rows):
                pass
            if first is not None:
                break
        if first is None:
            raise TitanError(f"dataset {self.name!r} is empty (no rows)")
        if self.text_field not in first[1]:
            raise TitanError(
                f"dataset {self.name!r} has no column {self.text_field!r} "
                f"(training.dataset_text_field); available columns: {sorted(first[1])}"
            )
