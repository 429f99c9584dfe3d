"""The titan logger survives the stream it first saw being closed (pytest capture, redirected stderr)."""

import io
import sys

from titan.tools.logging import init_logger, logger


def test_handler_follows_current_stderr_after_the_old_one_closed(monkeypatch):
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    for handler in [h for h in logger.handlers if getattr(h, "_titan_handler", False)]:
        logger.removeHandler(handler)
    init_logger(0)
    logger.info("to the first stream")
    assert "to the first stream" in first.getvalue()
    first.close()  # what pytest does to its capture stream after a test

    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logger.info("to the second stream")
    assert "to the second stream" in second.getvalue()
    assert "Logging error" not in second.getvalue()
    assert len([h for h in logger.handlers if getattr(h, "_titan_handler", False)]) == 1
