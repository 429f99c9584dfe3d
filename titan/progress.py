"""Progress bars for long operations with a known end (checkpoint conversion, downloads).

Drawn on stderr only when it is a terminal: logs, pipes and CI output get no bar lines.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def on_terminal() -> bool:
    return sys.stderr.isatty()


def progress(iterable: Iterable[T] | None = None, *, desc: str, total: int | None = None, unit: str = "it") -> tqdm:
    """tqdm over `iterable` (or a manual bar with `total`), disabled unless stderr is a terminal."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=not on_terminal(), leave=False, dynamic_ncols=True)
