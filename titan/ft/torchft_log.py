"""torchft's own log lines, kept off the console: the console carries titan's one line per replica
group event (joined, step discarded, healed, restarted), torchft's detail goes to a file.

- torchft's Python loggers (``torchft.*`` and its ``torchft_quorums`` / ``torchft_commits`` /
  ``torchft_errors``) write every record, tracebacks included, to
  ``<job.dump_folder>/torchft_replica<id>_rank<r>.log`` and nothing to the console (without a
  handler of their own, Python's last-resort handler would print their warnings and each failed
  collective's traceback there).
- torchft's Rust side (its manager's quorum and commit lines, several per step) writes straight to
  the process's standard error, which titan cannot send to a file; its level is torchft's
  ``RUST_LOG`` variable, which titan sets to ``warn`` unless the user set it (``RUST_LOG=info``
  brings the per-step lines back). torchft reads it once, when it is first imported: this runs
  before that import.
"""

from __future__ import annotations

import logging
import os

RUST_LOG_ENV = "RUST_LOG"
RUST_LOG_DEFAULT = "warn"
PY_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
_HANDLER_ATTR = "_titan_torchft_file"


def log_file(folder: str, replica_id: int, rank: int) -> str:
    return os.path.join(folder, f"torchft_replica{replica_id}_rank{rank}.log")


def route_torchft_logs(folder: str, replica_id: int, rank: int) -> str:
    """Send torchft's log lines to this rank's file under ``folder`` (appended: a restarted group
    adds to its earlier attempts' lines); the file's path."""
    os.environ.setdefault(RUST_LOG_ENV, RUST_LOG_DEFAULT)
    os.makedirs(folder, exist_ok=True)
    path = log_file(folder, replica_id, rank)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    setattr(handler, _HANDLER_ATTR, True)
    for name in PY_LOGGERS:
        log = logging.getLogger(name)
        for old in [h for h in log.handlers if getattr(h, _HANDLER_ATTR, False)]:
            log.removeHandler(old)  # a second Trainer in one process: one file, no stacked handlers
            old.close()
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return path
