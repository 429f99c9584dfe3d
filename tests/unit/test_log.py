"""Console colour decisions, quiet torchao imports, and a logger that survives the stream it first
saw being closed (pytest capture, redirected stderr) — titan/log.py."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from titan.log import color_enabled, init_logger, logger

REPO = Path(__file__).resolve().parents[2]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_color_only_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert color_enabled(stream=_Tty())
    assert not color_enabled(stream=io.StringIO())  # a file or pipe
    assert not color_enabled(disabled=True, stream=_Tty())  # metrics.disable_color_printing
    real = open(os.devnull)  # isatty() on a closed file raises: answer no colour instead
    real.close()
    assert not color_enabled(stream=real)


@pytest.mark.parametrize("value, colored", [("1", False), ("", True)])
def test_no_color_env(monkeypatch, value, colored):
    monkeypatch.setenv("NO_COLOR", value)  # https://no-color.org: any non-empty value
    assert color_enabled(stream=_Tty()) is colored


@pytest.mark.slow
def test_training_log_to_a_pipe_has_no_ansi_codes(tmp_path):
    """The real entry point with stderr piped: no escape codes, no torchao or comm noise."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "NO_COLOR")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "train_configs/debug_model.toml",
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "1",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--metrics.enable_tensorboard",
            "false",
            "--float8.enable_float8_linear",
            "--float8.emulate",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "\033[" not in text
    assert "step:  1" in text
    for noise in ("Failed to load", "Skipping import of cpp extensions", "register_constant", "[comm]"):
        assert noise not in text, text


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
