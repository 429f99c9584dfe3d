"""In-memory snapshots on 2 ranks that play 2 nodes of one machine (GROUP_RANK 0 and 1,
LOCAL_WORLD_SIZE 1, each node its own memory folder under /dev/shm), each phase a restart of the
last, every loss compared with the uninterrupted run's:

1. rank 1 is killed while it writes its step-6 snapshot (data copied, manifest not): torn;
2. the restart ignores the torn snapshot and resumes from memory at step 5 (newer than the disk
   checkpoint step-4); rank 0 is killed after step 7;
3. node 0's memory folder is removed: rank 0's state comes from the copy rank 1 keeps (step 6);
   rank 1 is killed after step 9;
4. both memory folders are removed: the disk checkpoint step-8, then training to the end removes
   the snapshots.

Kill points (tests/helpers/debug_kill.py), never timers; each snapshot is waited for before the
next step, so none is skipped for still copying (which a loaded machine would decide). The ranks
are forked from the fork server that has imported torch and train.py (tests/helpers/distributed.py).
"""

import re
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from tests.helpers.distributed import _free_port, forkserver
from tests.helpers.runs import SMALL_MODEL, STEP_RE, TINY_CKPT, train_in_child

pytestmark = pytest.mark.slow
STEPS = 10
ARGS = [
    *TINY_CKPT,
    *SMALL_MODEL,
    "--training.steps",
    str(STEPS),
    "--checkpoint.interval",
    "4",
    "--lr_scheduler.decay_ratio",
    "0",
]


def _whole_snapshots() -> None:
    """In this forked rank: every snapshot is done (or failed) before the next step begins."""
    from titan.checkpointing.memory_snapshot import MemorySnapshots

    original = MemorySnapshots.after_step

    def after_step(self, step: int, busy: bool, failed: bool) -> None:
        original(self, step, busy, failed)
        if self._job is not None:
            self._job.future.exception()  # blocks until the background copy ends

    MemorySnapshots.after_step = after_step


def _rank(rank: int, port: int, folder: str, memory: str, log: str, kill_at: str) -> None:
    # rank r alone on node r, as torchrun numbers them
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    argv = [*ARGS, "--job.dump_folder", folder, "--checkpoint.memory_folder", f"{memory}/node{rank}"]
    _whole_snapshots()
    train_in_child(argv, log, kill_at, env)


def _run(tmp: Path, name: str, folder: Path, memory: Path, kill_at: str = "") -> tuple[list, list[str]]:
    """Both ranks once: their exit codes and logs."""
    ctx, port = forkserver(), _free_port()
    logs = [tmp / f"{name}.rank{r}.log" for r in range(2)]
    procs = [
        ctx.Process(target=_rank, args=(r, port, str(folder), str(memory), str(logs[r]), kill_at)) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)  # a guard against a hang, not a race: each run ends by itself
        if p.exitcode is None:
            p.kill()
            p.join()
    return [p.exitcode for p in procs], [log.read_text() for log in logs]


def _losses(text: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in STEP_RE.finditer(text)}


@pytest.fixture
def memory():
    """A memory folder of this test's own under /dev/shm (two fake nodes in it), removed after."""
    path = Path("/dev/shm") / f"titan-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_restart_from_own_snapshot_then_peer_copy_then_disk(tmp_path, memory):
    codes, logs = _run(tmp_path, "ref", tmp_path / "ref", memory)
    ref = _losses(logs[0])
    assert codes == [0, 0] and sorted(ref) == list(range(1, STEPS + 1)), logs[0][-3000:]
    run = tmp_path / "run"

    # 1. rank 1 dies inside its step-6 snapshot: its newest slot is torn
    codes, logs = _run(tmp_path, "p1", run, memory, "snapshot:step=6@rank1")
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, logs[1][-3000:]
    own1 = next((memory / "node1").glob("titan-*/rank1"))  # two slots written, one manifest: step 5's
    assert len(list(own1.glob("*.data"))) == 2 and len(list(own1.glob("*.json"))) == 1, list(own1.iterdir())

    # 2. the torn one is ignored: memory step 5, newer than the disk's step-4; rank 0 dies after step 7
    codes, logs = _run(tmp_path, "p2", run, memory, "step=7@rank0")
    assert codes[0] == -signal.SIGKILL, logs[0][-3000:]
    assert "rank(s) [1] were being written when they stopped (torn" in logs[0], logs[0][-3000:]
    assert "resumed from the in-memory snapshot of step 5" in logs[0], logs[0][-3000:]
    losses = _losses(logs[0])
    assert sorted(losses) == [6, 7] and all(losses[s] == ref[s] for s in losses), (losses, ref)

    # 3. node 0 lost its memory: rank 0 restores from the copy rank 1 keeps; rank 1 dies after step 9
    shutil.rmtree(memory / "node0")
    codes, logs = _run(tmp_path, "p3", run, memory, "step=9@rank1")
    assert codes[1] == -signal.SIGKILL, (codes, logs[1][-3000:])
    assert re.search(r"resumed from the in-memory snapshot of step 6 .*rank 0 <- rank 1", logs[0]), logs[0][-3000:]
    losses = _losses(logs[0])
    assert sorted(losses) == [7, 8, 9] and all(losses[s] == ref[s] for s in losses), (losses, ref)

    # 4. every copy lost: the disk checkpoint step-8; the run's end removes its snapshots
    shutil.rmtree(memory / "node0")
    shutil.rmtree(memory / "node1")
    codes, logs = _run(tmp_path, "p4", run, memory)
    assert codes == [0, 0], logs[0][-3000:]
    assert "resumed from" in logs[0] and "step-8: step 8" in logs[0], logs[0][-3000:]
    losses = _losses(logs[0])
    assert sorted(losses) == [9, 10] and all(losses[s] == ref[s] for s in losses), (losses, ref)
    assert not list(memory.glob("node*/titan-*")), list(memory.rglob("*"))
