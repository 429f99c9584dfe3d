"""Plain .jsonl files read line by line, so a broken line can be named (file:line) and, if the
config says so (training.dataset_bad_lines = "skip"), dropped with a count instead of stopping.

Document i is the i-th *good* row over the files in order: the numbering (hence sharding and
resume) stays deterministic whether or not lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from titan.errors import TitanError
from titan.tools.logging import logger

from .datasets import DocumentSource

_SHOW = 5
SCAN_LINES = 1000  # skipped lines named one by one in the log; the rest only counted


class JsonlSource(DocumentSource):
    def __init__(self, name: str, files: list[Path], text_field: str, bad_lines: str = "fail") -> None:
        if bad_lines not in ("fail", "skip"):
            raise TitanError(f"config key 'training.dataset_bad_lines' got {bad_lines!r}; valid: fail, skip")
        self.name, self.files, self.text_field, self.bad_lines = name, files, text_field, bad_lines
        self.skipped = 0

    def _bad(self, where: str, why: str) -> None:
        if self.bad_lines == "fail":
            raise TitanError(f"{where}: {why}; fix the line or set training.dataset_bad_lines = \"skip\"")
        self.skipped += 1
        if self.skipped <= _SHOW:
            logger.warning(f"{where}: {why}; skipped {self.skipped} broken line(s) so far"
                           " (training.dataset_bad_lines = skip)")

    def _rows(self) -> Iterator[dict]:
        self.skipped = 0
        for f in self.files:
            with open(f, "rb") as fh:
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
                    yield row

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        field = self.text_field
        for i, row in enumerate(self._rows()):
            if i < start:
                continue
            text = row.get(field)
            if not isinstance(text, str):
                raise TitanError(f"dataset {self.name!r}: document {i} has no text in column {field!r} "
                                 f"(got {type(text).__name__}); set training.dataset_text_field to a text column")
            yield text

    def validate(self) -> None:
        """Fail early on an empty file, a missing text column, or (in "fail" mode) a broken line
        among the first SCAN_LINES rows; later broken lines are met, and named, while training."""
        rows = self._rows()
        first = next(rows, None)
        for _ in zip(range(SCAN_LINES), rows):
            pass
        if first is None:
            raise TitanError(f"dataset {self.name!r} is empty (no rows)")
        if self.text_field not in first:
            raise TitanError(
                f"dataset {self.name!r} has no column {self.text_field!r} "
                f"(training.dataset_text_field); available columns: {sorted(first)}"
            )
