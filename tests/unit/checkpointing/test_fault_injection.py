"""kill -9 at 10 seeded points of a 1-rank run with async checkpoints, 5 of them inside an async
save (its files written, its COMPLETE marker not) and 5 right after a step: every restart resumes
from the newest intact checkpoint, its losses equal the uninterrupted run's, and no damaged
checkpoint is ever loaded.

Each run kills itself at its point (tests/helpers/debug_kill.py), exactly like ``kill -9``: the
test never races a timer against the run. The runs are forked by a multiprocessing fork server
that has imported torch and train.py once, so a restart costs no torch import; the fork server is
a fresh single-threaded process (forking pytest itself, after earlier tests started OpenMP/gloo
threads, can deadlock the child).
"""

import random
import re
import signal
from pathlib import Path

import pytest

from tests.helpers.distributed import forkserver
from tests.helpers.runs import SMALL_MODEL, STEP_RE, TINY_CKPT, train_in_child
from titan.checkpointing.folders import scan
from titan.checkpointing.manifest import verify

pytestmark = pytest.mark.slow
STEPS = 14
ARGS = [
    *TINY_CKPT,
    *SMALL_MODEL,
    "--training.steps",
    str(STEPS),
    "--checkpoint.interval",
    "2",
    "--checkpoint.async_mode",
    "async",
    # the disk checkpoints under test: a restart would take the newer in-memory snapshot
    "--checkpoint.memory_interval",
    "0",
]
RESUMED = re.compile(r"resumed from (\S+): step (\d+)")


def _train(folder: str, log: str, kill_at: str) -> None:
    train_in_child([*ARGS, "--job.dump_folder", folder], log, kill_at)


def _run(ctx, folder: Path, log: Path, kill_at: str = "", timeout: float = 300) -> int:
    """One run (killed at ``kill_at``, if given); its exit status (-9: killed)."""
    log.write_text("")
    proc = ctx.Process(target=_train, args=(str(folder), str(log), kill_at))
    proc.start()
    proc.join(timeout)  # a guard against a hung run, not a race: each run ends by itself
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"run did not end in {timeout} s: {log.read_text()[-2000:]}")
    return proc.exitcode


def _losses(log: Path) -> dict[int, str]:
    return {int(m[1]): m[2] for m in STEP_RE.finditer(log.read_text())}


def test_kill_9_at_random_points_resumes_exactly(tmp_path):
    ctx = forkserver()  # the fork server run_distributed's ranks share: it has imported torch and train.py
    code = _run(ctx, tmp_path / "ref", tmp_path / "ref.log")
    ref = _losses(tmp_path / "ref.log")
    assert code == 0 and sorted(ref) == list(range(1, STEPS + 1)), (tmp_path / "ref.log").read_text()[-3000:]

    rng = random.Random(1234)
    kinds = ["save"] * 5 + ["step"] * 5
    rng.shuffle(kinds)
    run, root = tmp_path / "run", tmp_path / "run/checkpoint"
    resumed_steps = []
    for i, kind in enumerate(kinds):
        log = tmp_path / f"run{i}.log"
        intact = [f for f in scan(str(root)) if f.complete]
        expected = intact[-1].step if intact else 0
        assert all(verify(f.path) is None for f in intact)  # whatever is committed is whole
        if kind == "save":  # inside the next save or the one after (the final save at most)
            at = min(expected + 2 * rng.randint(1, 2), STEPS)
            kill_at = f"save:step={at}"
        else:  # right after a later step, before its save (an async save may still be writing)
            at = min(expected + rng.randint(3, 4), STEPS - 1)
            kill_at = f"step={at}"
        code = _run(ctx, run, log, kill_at)
        text = log.read_text()
        assert code == -signal.SIGKILL, f"run {i} ended without reaching {kill_at}: {text[-3000:]}"
        if kind == "save":  # killed inside the save: its folder is on disk, uncommitted
            assert any(f.step == at and not f.complete for f in scan(str(root))), (i, kill_at)
        m = RESUMED.search(text)
        assert (int(m[2]) if m else 0) == expected, text[-3000:]
        resumed_steps.append(expected)
        losses = _losses(log)
        assert losses and all(losses[s] == ref[s] for s in losses), (i, losses, ref)
        assert "is damaged" not in text
    code = _run(ctx, run, tmp_path / "final.log")
    losses = _losses(tmp_path / "final.log")
    assert code == 0 and losses == {s: ref[s] for s in losses} and max(losses) == STEPS
    assert resumed_steps == sorted(resumed_steps) and resumed_steps[-1] > 0
