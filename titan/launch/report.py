"""How titan's processes end on a user error: one line on stderr (``titan: error: ...``), the same line
in torchrun's error file (so that the launcher, titan.launch, can print it as the last line instead
of a traceback) and exit status 2. ``exit_status`` is the one place that turns a TitanError into
that, for the rank entry, the pre-launch check and --help alike."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from titan.errors import TitanError

USER_ERROR_STATUS = 2  # a titan error line: it would fail again on every attempt
PEER_LOST_STATUS = 3  # a rank whose peer failed during a collective: the peer's line says why
# A rank's line when only its peer failed: the launcher never takes it for the cause.
PEER_LOST_PHRASE = "another rank failed during a collective"


def debug_requested(argv: list[str]) -> bool:
    """TITAN_DEBUG or --job.debug: tracebacks instead of one line. Looked for in argv, since a config
    that fails to load has no job.debug yet."""
    return bool(os.environ.get("TITAN_DEBUG")) or "--job.debug" in argv


def write_error_file(line: str) -> bool:
    """torchrun gives each rank a file (TORCHELASTIC_ERROR_FILE) whose message it reports as the
    rank's failure; {"message": str, "timestamp": int} is the form it reads. True when written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        return False  # then the rank prints it: a missing report only costs the launcher's summary
    return True


def emit(line: str) -> None:
    """A rank's last line: into its error file, and on stderr unless titan's launcher (which prints
    the cause's line last, whatever ranks the console shows) reads it from there: it appears once."""
    from titan.launch.parent import LAUNCHER_PID_ENV

    if not (write_error_file(line) and os.environ.get(LAUNCHER_PID_ENV)):
        print(line, file=sys.stderr, flush=True)


def _process_group_started() -> bool:
    # torch.distributed is imported only by code that needs it: a config error comes before it
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def report(error: TitanError, after_init: bool) -> None:
    rank = os.environ.get("RANK", "0")
    # Before the process group exists every rank hits the same error: rank 0 prints it.
    # Later errors can be rank-specific, so a failing rank reports with its id.
    if after_init and rank != "0" and not getattr(error, "same_on_all_ranks", False):
        emit(f"titan: error on rank {rank}: {error}")
    elif rank == "0":
        emit(f"titan: error: {error}")
    else:
        write_error_file(f"titan: error: {error}")


def _never() -> bool:
    return False


def exit_status(body: Callable[[], int], *, debug: Callable[[], bool] = _never) -> int:
    """``body()``'s exit status; a TitanError it raises is reported (its one line) and ends with
    USER_ERROR_STATUS, or is raised on when ``debug()`` says a traceback is wanted."""
    try:
        return body()
    except TitanError as e:
        if debug():
            raise
        # read now, while a failed Trainer's process group still exists
        report(e, after_init=_process_group_started())
        return USER_ERROR_STATUS
