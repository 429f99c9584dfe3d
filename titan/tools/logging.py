"""The project logger: ``from titan.tools.logging import logger``.

``init_logger(rank)`` gives the "titan" logger one stream handler with a fixed format. The logger
keeps propagating to the root logger so pytest's ``caplog`` still sees records; nothing prints
twice unless the application also configures the root logger with a handler.
"""

from __future__ import annotations

import logging
import sys

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
    def stream(self):  # noqa: ANN201 - a text stream
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001 - StreamHandler.setStream assigns; stderr wins
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
