"""What the launcher can say about a rank that failed without a titan line of its own.

- Its last error lines: with ``--local-ranks-filter`` (run_train.sh's LOG_RANK) a failed rank's
  output may never have reached the console; torchrun's ``--tee`` still wrote it to a file, from
  which the launcher shows the end of its traceback (``error_tail``), once.
- A SIGKILL: titan and torchrun never send one to a rank that has not hung, so it came from outside
  (the kernel's out-of-memory killer, a scheduler, a user). Only the kernel's own count of OOM kills
  in this process's memory cgroup (``oom_kill_count``) makes out-of-memory more than a guess.
"""

from __future__ import annotations

import os
from pathlib import Path

TAIL_LINES = 6  # the last frames and the exception: enough to see where and why
_TAIL_BYTES = 256 * 1024


def _cgroup_files() -> list[Path]:
    """The files holding this process's memory cgroup's ``oom_kill`` count (cgroup v2, then v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            out.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control")
    return out


def oom_kill_count() -> int | None:
    """The kernel's count of processes its OOM killer ended in this process's memory cgroup (which
    holds the ranks it starts), or None where the system does not say."""
    for path in _cgroup_files():
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill" and value.strip().isdigit():
                    return int(value)
        except OSError:
            continue
    return None


def sigkill_phrase(oom_before: int | None, oom_after: int | None) -> str:
    """What is known about a SIGKILL from outside: the OOM killer only when the kernel counted one."""
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        return (
            f"the kernel's out-of-memory killer ended {oom_after - oom_before} process(es) of this job's memory"
            " cgroup meanwhile: out of memory"
        )
    return (
        "SIGKILL (signal 9) came from outside titan and torchrun (a scheduler, a user or the kernel;"
        " the system log says which)"
    )


def error_tail(path: str, lines: int = TAIL_LINES) -> list[str]:
    """The last lines of a rank's stderr file that say why it failed: the end of its last traceback
    (its last frames and the exception line), else its last non-empty lines; [] when unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    rows = [r.rstrip() for r in text.splitlines()]
    starts = [i for i, r in enumerate(rows) if r.startswith("Traceback (most recent call last):")]
    if not starts:
        return [r for r in rows if r.strip()][-lines:]
    block = rows[starts[-1] :]
    # the exception line is the first unindented line after the frames
    end = next((i for i, r in enumerate(block) if i and r and not r[0].isspace()), len(block) - 1)
    return [r for r in block[: end + 1] if r.strip()][-lines:]
