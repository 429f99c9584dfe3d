"""How a rank reports a user error: one line on stderr, and the same line in torchrun's error file,
so that the launcher (titan.launch) can print it as the last line instead of a traceback."""

from __future__ import annotations

import json
import os
import sys
import time

from titan.errors import TitanError

# A rank's line when only its peer failed (train.py exits 3): the launcher never takes it for the cause.
PEER_LOST_PHRASE = "another rank failed during a collective"


def write_error_file(line: str) -> None:
    """torchrun gives each rank a file (TORCHELASTIC_ERROR_FILE) whose message it reports as the
    rank's failure; {"message": str, "timestamp": int} is the form it reads."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the line is on stderr already; a missing report only costs the launcher's summary


def report(error: TitanError, after_init: bool) -> None:
    rank = os.environ.get("RANK", "0")
    # Before the process group exists every rank hits the same error: rank 0 prints it.
    # Later errors can be rank-specific, so a failing rank reports with its id.
    if rank == "0":
        line = f"titan: error: {error}"
        print(line, file=sys.stderr)
    elif after_init and not getattr(error, "same_on_all_ranks", False):
        line = f"titan: error on rank {rank}: {error}"
        print(line, file=sys.stderr)
    else:
        line = f"titan: error: {error}"
    write_error_file(line)
