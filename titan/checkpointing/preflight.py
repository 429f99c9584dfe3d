"""Checks of the checkpoint folder made before training starts, so a run that cannot save fails
at once (one line) instead of after hours, and rules that keep an earlier run's checkpoints safe.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from titan.checkpointing.folders import Found, scan
from titan.errors import TitanError

# A full checkpoint holds fp32 weights and AdamW's two fp32 moments: 12 bytes per parameter, plus
# slack for metadata and the data loader state.
BYTES_PER_PARAM = 12
SLACK_BYTES = 16 * 2**20


def checkpoint_bytes(num_params: int) -> int:
    return num_params * BYTES_PER_PARAM + SLACK_BYTES


def check_checkpoint_folder(root: str, need_bytes: int) -> None:
    """``root`` is (or can be made) a folder this process can write, on a disk with room for a checkpoint."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise TitanError(
            f"checkpoint.folder {root} is not a writable folder (a file is in the way);"
            " move the file or set job.dump_folder / checkpoint.folder elsewhere"
        )
    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise TitanError(
            f"checkpoint.folder {root} is not a writable folder ({e.strerror});"
            " fix its permissions or set job.dump_folder elsewhere"
        ) from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise TitanError(
            f"checkpoint.folder {root} has {free / 2**20:.0f} MiB free; one checkpoint needs about"
            f" {need_bytes / 2**20:.0f} MiB (weights + AdamW state): free disk space or set"
            " job.dump_folder on a larger disk"
        )


def check_no_later_checkpoints(found: Found, root: str, overwrite: bool) -> None:
    """Resuming from an older load_step would replace the later steps on its next saves."""
    later = [f.step for f in scan(root) if f.complete and f.step > found.step]
    if later and not overwrite:
        raise TitanError(
            f"checkpoint.load_step {found.step}: {root} also holds later checkpoints"
            f" {', '.join(f'step-{s}' for s in later)} that training from step {found.step}"
            " would replace; pass --job.overwrite to allow it, or drop checkpoint.load_step"
        )


def clear_for_fresh_start(root: str) -> list[str]:
    """--job.overwrite without load_step: the checkpoints of an earlier run go, training starts fresh."""
    gone = [f.path for f in scan(root)]
    for path in gone:
        shutil.rmtree(path)
    return gone
