"""kill -9 at 10 random (seeded) points of a 1-rank run with async checkpoints, 5 of them while an
async save is being written (a step folder without its COMPLETE marker is on disk): every restart
resumes from the newest intact checkpoint, its losses equal the uninterrupted run's, and no
damaged checkpoint is ever loaded.

The runs are forked by a multiprocessing fork server that has imported torch and train.py once,
so a restart costs no torch import; the fork server is a fresh single-threaded process (forking
pytest itself, after earlier tests started OpenMP/gloo threads, can deadlock the child). The
child is SIGKILLed exactly like ``kill -9``.
"""

import logging
import multiprocessing as mp
import os
import random
import re
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.runs import STEP_RE, TINY_CKPT
from titan.checkpointing.folders import scan
from titan.checkpointing.manifest import verify

pytestmark = pytest.mark.slow
STEPS = 14
# a 2-layer, dim-64 debug model: small checkpoints, fast steps
ARGS = [
    *TINY_CKPT,
    "--model.dim",
    "64",
    "--model.n_layers",
    "2",
    "--model.n_heads",
    "4",
    "--model.n_kv_heads",
    "2",
    "--training.steps",
    str(STEPS),
    "--checkpoint.interval",
    "2",
    "--checkpoint.async_mode",
    "async",
]
RESUMED = re.compile(r"resumed from (\S+): step (\d+)")


def _train(folder: str, log: str) -> None:
    code = 1
    try:
        out = open(log, "a", buffering=1)
        sys.stdout = sys.stderr = out
        for h in logging.getLogger("titan").handlers:
            if isinstance(h, logging.StreamHandler):
                h.setStream(out)
        os.environ.pop("TITAN_DEBUG_KILL_AT", None)
        import train

        code = train.main([*ARGS, "--job.dump_folder", folder])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def _start(ctx, folder: Path, log: Path):
    log.write_text("")  # exists before the parent polls it
    proc = ctx.Process(target=_train, args=(str(folder), str(log)))
    proc.start()
    return proc


def _losses(log: Path) -> dict[int, str]:
    return {int(m[1]): m[2] for m in STEP_RE.finditer(log.read_text())}


def _torn(root: Path) -> set[tuple[int, int, int]]:
    """Uncommitted step folders, each with its inode and ctime: a folder replaced by a new save
    of the same step counts as new."""
    out = set()
    for f in scan(str(root)):
        if not f.complete:
            try:
                st = os.stat(f.path)
            except FileNotFoundError:
                continue
            out.add((f.step, st.st_ino, st.st_ctime_ns))
    return out


def _newest(root: Path) -> int:
    return max((f.step for f in scan(str(root)) if f.complete), default=0)


def _run_until(ctx, folder: Path, log: Path, stop, timeout: float = 120) -> tuple[int | None, bool]:
    """Start a run; SIGKILL it when ``stop()`` says so. Returns (exit status or None if killed,
    whether a save was in flight at the kill)."""
    proc = _start(ctx, folder, log)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.exitcode is not None:
            return proc.exitcode, False
        if stop():
            inside = bool(_torn(folder / "checkpoint"))
            proc.kill()
            proc.join()
            return None, inside
        time.sleep(0.002)
    proc.kill()
    proc.join()
    raise AssertionError(f"run did not finish in {timeout} s: {log.read_text()[-2000:]}")


def test_kill_9_at_random_points_resumes_exactly(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "train"])
    code, _ = _run_until(ctx, tmp_path / "ref", tmp_path / "ref.log", lambda: False)
    ref = _losses(tmp_path / "ref.log")
    assert code == 0 and sorted(ref) == list(range(1, STEPS + 1)), (tmp_path / "ref.log").read_text()[-3000:]

    rng = random.Random(1234)
    kinds = ["save"] * 5 + ["step"] * 5
    rng.shuffle(kinds)
    run, root = tmp_path / "run", tmp_path / "run/checkpoint"
    inside, resumed_steps = 0, []
    for i, kind in enumerate(kinds):
        log = tmp_path / f"run{i}.log"
        intact = [f for f in scan(str(root)) if f.complete]
        expected = intact[-1].step if intact else 0
        assert all(verify(f.path) is None for f in intact)  # whatever is committed is whole
        target = min(expected + rng.randint(3, 4), STEPS - 1)  # past the next save, so runs make progress
        if kind == "save":  # as soon as a new save is on disk but not yet committed
            old = _torn(root)
            stop = lambda old=old: bool(_torn(root) - old)  # noqa: E731
        else:  # right after a random later step was logged
            # ...and a newer save has committed: an async save may still be writing when the
            # target step is logged, and a kill before its commit would make no progress
            progress = expected + 2 < STEPS  # the next save is not the final one
            stop = lambda log=log, target=target, expected=expected, progress=progress: (  # noqa: E731
                max(_losses(log), default=0) >= target and (_newest(root) > expected or not progress)
            )
        code, was_inside = _run_until(ctx, run, log, stop)
        text = log.read_text()
        assert code is None, f"run {i} ended before its kill point: {text[-3000:]}"
        inside += was_inside
        m = RESUMED.search(text)
        assert (int(m[2]) if m else 0) == expected, text[-3000:]
        resumed_steps.append(expected)
        losses = _losses(log)
        assert losses and all(losses[s] == ref[s] for s in losses), (i, losses, ref)
        assert "is damaged" not in text
    assert inside >= 5, f"only {inside} kills landed inside an async save"
    code, _ = _run_until(ctx, run, tmp_path / "final.log", lambda: False)
    losses = _losses(tmp_path / "final.log")
    assert code == 0 and losses == {s: ref[s] for s in losses} and max(losses) == STEPS
    assert resumed_steps == sorted(resumed_steps) and resumed_steps[-1] > 0
