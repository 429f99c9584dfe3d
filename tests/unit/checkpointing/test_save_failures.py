"""Save failures on real file systems: a small tmpfs that fills up (async and sync) and a file
system remounted read-only mid-run. Each gives one line naming the folder, the cause in words and
what to do; the partial folder is gone (the disk is free again), earlier checkpoints stay. Also:
the per-rank (exception, traceback) structure of DCP's CheckpointException, and on_save_error=retry."""

import errno
import os
import shutil
import signal
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from tests.helpers.debug_kill import kill_env, wait_stopped
from tests.helpers.runs import REPO, TINY_CKPT, run_env, train_subprocess
from titan.checkpointing.failure import explain

# debugmodel: one full checkpoint is ~70 MB; 100 MB holds one (and passes the start-up space check,
# which wants ~85 MB free) but not two.
TMPFS_MB = 100


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}M", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _check_failed_run(rc: int, text: str, folder: Path, failed_step: int, cause: str) -> None:
    errors = [line for line in text.splitlines() if line.startswith("titan: error")]
    assert rc == 2 and len(errors) == 1, text[-3000:]
    line = errors[0]
    assert f"checkpoint step {failed_step}: writing {folder / f'step-{failed_step}'} failed: {cause}" in line, line
    assert "partial folder was removed" in line and "newest: step-" in line, line
    assert "Traceback" not in text, text[-3000:]
    assert not (folder / f"step-{failed_step}").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "disabled"])
def test_full_disk_on_real_tmpfs(tmp_path, tmpfs, mode):
    ckpt = tmpfs / "ckpt"
    rc, text, _ = train_subprocess(
        tmp_path / "run",
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "2",
        "--checkpoint.folder",
        str(ckpt),
        "--checkpoint.async_mode",
        mode,
    )
    _check_failed_run(rc, text, ckpt, 4, "no space left on device")
    assert "free disk space" in text
    assert (ckpt / "step-2/COMPLETE").is_file() and sorted(p.name for p in ckpt.iterdir()) == ["step-2"]
    assert shutil.disk_usage(tmpfs).free > 20 * 2**20  # the partial step-4 no longer fills the disk


@pytest.mark.slow
def test_full_disk_retry_keeps_training(tmp_path, tmpfs):
    ckpt = tmpfs / "ckpt"
    rc, text, steps = train_subprocess(
        tmp_path / "run",
        "--training.steps",
        "7",
        "--checkpoint.interval",
        "2",
        "--checkpoint.folder",
        str(ckpt),
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.on_save_error",
        "retry",
        "--checkpoint.keep_latest_k",
        "1",
    )
    # step-4 and step-6 fail (a second checkpoint never fits), training reaches 7, whose final save stops
    assert sorted(steps) == list(range(1, 8)), text[-3000:]
    assert text.count("on_save_error=retry: training goes on") == 2, text[-3000:]
    _check_failed_run(rc, text, ckpt, 7, "no space left on device")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2"]


@pytest.mark.slow
def test_read_only_file_system_mid_run(tmp_path, tmpfs):
    ckpt = tmpfs / "ckpt"
    cmd = [
        sys.executable,
        "train.py",
        *TINY_CKPT,
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--training.steps",
        "12",
        "--checkpoint.interval",
        "6",
        "--checkpoint.folder",
        str(ckpt),
        "--checkpoint.async_mode",
        "async",
    ]
    # the run stops itself once step 6 is committed, so the remount lands between the two saves
    env = run_env(**kill_env("stop:committed=6"))
    out_file = tmp_path / "out.log"
    with out_file.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        wait_stopped(proc.pid)
        remount = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True, text=True)
        os.kill(proc.pid, signal.SIGCONT)
        proc.wait(timeout=240)
        out = out_file.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    if remount.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {remount.stderr.strip()}")
    _check_failed_run(proc.returncode, out, ckpt, 12, "read-only file system")
    assert "remount it read-write" in out
    assert (ckpt / "step-6/COMPLETE").is_file()


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:
        return e


def test_checkpoint_exception_structure_is_unwrapped(tmp_path):
    """DCP's CheckpointException: a BaseException whose failures map rank -> (exception, traceback)."""
    assert not issubclass(CheckpointException, Exception)
    disk = _raised(OSError(errno.ENOSPC, "No space left on device"))
    perm = _raised(PermissionError(errno.EACCES, "Permission denied"))
    zip_full = _raised(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    cause, advice = explain(CheckpointException("write", {3: _wrap_exception(disk)}), str(tmp_path))
    assert cause.startswith("no space left on device on rank 3; OSError") and "larger disk" in advice
    cause, advice = explain(CheckpointException("write", {0: _wrap_exception(perm)}), str(tmp_path))
    assert cause.startswith("permission denied; PermissionError") and "permissions" in advice
    # no errno anywhere: the cause is the exception itself, named with its type and message
    cause, advice = explain(CheckpointException("write", {1: _wrap_exception(zip_full)}), str(tmp_path))
    assert cause == "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598 on rank 1"
    # an OSError further down the chain (raise ... from) still names the cause
    chained = _raised(RuntimeError("writer failed"))
    chained.__cause__ = disk
    assert explain(chained, str(tmp_path))[0].startswith("no space left on device; RuntimeError: writer failed")
    assert isinstance(traceback.extract_tb(disk.__traceback__), traceback.StackSummary)


def test_read_only_probe_names_the_cause(tmp_path, tmpfs):
    (tmpfs / "x").mkdir()
    if subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], capture_output=True).returncode != 0:
        pytest.skip("cannot remount the tmpfs read-only")
    cause, advice = explain(RuntimeError("unexpected pos 0 vs 12"), str(tmpfs / "x" / "step-4"))
    assert cause.startswith("read-only file system; RuntimeError") and "read-write" in advice
    assert not os.access(tmpfs, os.W_OK)
