"""The project logger: ``from titan.log import logger``.

``init_logger(rank)`` gives the "titan" logger one stream handler with a fixed format. The logger
keeps propagating to the root logger so pytest's ``caplog`` still sees records; nothing prints
twice unless the application also configures the root logger with a handler.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from typing import IO

logger = logging.getLogger("titan")

# Marks the handler we installed so repeated init_logger() calls replace its format instead of
# stacking a second handler (which would print every line twice).
_HANDLER_ATTR = "_titan_handler"


def _format(rank: int) -> str:
    rank_part = f" [rank {rank}]" if rank != 0 else ""
    return f"[titan]{rank_part} %(asctime)s - %(levelname)s - %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time. A plain StreamHandler keeps the stream it
    was built with: once that object is closed (pytest's capture of an earlier test, a redirected
    stderr), every later record fails with "I/O operation on closed file"."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:  # StreamHandler.setStream assigns; stderr wins
        pass


def init_logger(rank: int = 0) -> logging.Logger:
    """Configure the "titan" logger (level INFO, one stream handler). Safe to call repeatedly."""
    logger.setLevel(logging.INFO)
    formatter = logging.Formatter(_format(rank))
    for handler in logger.handlers:
        if getattr(handler, _HANDLER_ATTR, False):
            handler.setFormatter(formatter)
            return logger
    handler = _StderrHandler()
    handler.setLevel(logging.INFO)
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_ATTR, True)
    logger.addHandler(handler)
    return logger


def color_enabled(disabled: bool = False, stream: IO[str] | None = None) -> bool:
    """Whether to print ANSI colours: only for a person at a terminal. Never when the config turns
    them off, never with a non-empty NO_COLOR (https://no-color.org), never into a file or pipe
    (under torchrun the workers' output goes to a pipe and log files, so it stays plain).
    ``stream``: where the lines go (default: the stream of the titan log handler, else stderr)."""
    if disabled or os.environ.get("NO_COLOR"):
        return False
    if stream is None:
        handlers = [h for h in logger.handlers if getattr(h, _HANDLER_ATTR, False)]
        stream = getattr(handlers[0], "stream", None) if handlers else sys.stderr
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


# Import-time lines from torchao that say nothing about the user's run: the notice that its C++
# kernels were skipped (titan/__init__.py asks for that) and torch's deprecation warning about how
# torchao registers one of its enums with pytree.
_IMPORT_NOISE = (
    ("torchao", "Skipping import of cpp extensions"),
    ("torch.utils._pytree", "register_constant() on Enum"),
)


class _DropContaining(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def import_torchao(module: str) -> types.ModuleType:
    """``importlib.import_module(module)`` for a torchao module, without torchao's import noise.

    Raises ImportError like a plain import (callers turn it into their own message)."""
    filters = [(logging.getLogger(name), _DropContaining(text)) for name, text in _IMPORT_NOISE]
    for log, f in filters:
        log.addFilter(f)
    try:
        return importlib.import_module(module)
    finally:
        for log, f in filters:
            log.removeFilter(f)
