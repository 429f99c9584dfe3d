"""Turning a failed checkpoint write into one line that names the cause and what to do.

DCP reports failures as ``CheckpointException`` (a ``BaseException``, not an ``Exception``) whose
``failures`` map each failing rank to an ``(exception, StackSummary)`` pair; an async save delivers
the same through its future. The real cause is often not an ``OSError`` at all: a full disk inside
torch's zip writer surfaces as ``RuntimeError: [enforce fail at inline_container.cc] unexpected
pos ...``. So besides walking the exception chain for an errno, the folder is probed afterwards
(free space, writability) to name the cause in words.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from types import MappingProxyType

from torch.distributed.checkpoint.api import CheckpointException

# Below this much free space after a failed write, the disk being full is the cause.
FULL_DISK_BYTES = 1 << 20

_CAUSES = MappingProxyType(
    {
        errno.ENOSPC: ("no space left on device", "free disk space or set job.dump_folder on a larger disk"),
        errno.EDQUOT: ("disk quota exceeded", "free space within your quota or set job.dump_folder elsewhere"),
        errno.EROFS: ("read-only file system", "remount it read-write or set job.dump_folder on a writable disk"),
        errno.EACCES: ("permission denied", "fix the folder's permissions or set job.dump_folder elsewhere"),
        errno.EPERM: ("permission denied", "fix the folder's permissions or set job.dump_folder elsewhere"),
    }
)


def rank_errors(error: BaseException) -> Iterator[tuple[int | None, BaseException]]:
    """(rank, exception) for every leaf failure, unwrapping (nested) CheckpointExceptions."""
    if isinstance(error, CheckpointException):
        for rank, entry in sorted(error.failures.items()):
            inner = entry[0] if isinstance(entry, tuple) else entry
            for r, leaf in rank_errors(inner):
                yield (rank if r is None else r), leaf
    else:
        yield None, error


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def _probe(folder: str) -> int | None:
    """The errno that explains a write failure in ``folder`` from the outside, if any."""
    probe_dir = folder
    while probe_dir and not os.path.isdir(probe_dir):
        probe_dir = os.path.dirname(probe_dir)
    if not probe_dir:
        return None
    try:
        if shutil.disk_usage(probe_dir).free < FULL_DISK_BYTES:
            return errno.ENOSPC
    except OSError:
        return None
    if not os.access(probe_dir, os.W_OK):
        try:
            return errno.EROFS if os.statvfs(probe_dir).f_flag & os.ST_RDONLY else errno.EACCES
        except OSError:
            return errno.EACCES
    return None


def explain(error: BaseException, folder: str) -> tuple[str, str]:
    """(cause, advice): the cause in words with the first exception on the first failing rank,
    and what to do about it."""
    leaves = list(rank_errors(error))
    rank, leaf = leaves[0]
    code = next((e.errno for _, x in leaves for e in _chain(x) if isinstance(e, OSError) and e.errno in _CAUSES), None)
    if code is None:
        code = _probe(folder)
    where = f" on rank {rank}" if rank else ""  # rank 0 (or a one-process run) goes unnamed
    detail = _first_line(leaf)
    if isinstance(leaf, KeyError) and "<class 'type'>" in str(leaf):
        detail += " (the staging buffers were released before this save)"
    if code is not None:
        words, advice = _CAUSES[code]
        return f"{words}{where}; {detail}", advice
    return f"{detail}{where}", "fix the cause (--job.debug shows the traceback)"


def save_failure(error: BaseException, path: str, root: str, step: int) -> tuple[str, str]:
    """(message, advice) of a failed save of ``step`` into ``path``, saying which earlier
    checkpoint under ``root`` is intact (the partial folder has been removed)."""
    from titan.checkpointing.folders import scan

    cause, advice = explain(error, path)
    newest = next((f"step-{f.step}" for f in reversed(scan(root)) if f.complete), None)
    kept = (
        f"earlier checkpoints in {root} are intact (newest: {newest})" if newest else f"no earlier checkpoint in {root}"
    )
    return f"checkpoint step {step}: writing {path} failed: {cause}; the partial folder was removed, {kept}", advice
