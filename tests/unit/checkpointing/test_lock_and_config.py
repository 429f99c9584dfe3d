"""One writer per dump folder (two real concurrent launches; stale locks), and auto-resume from a
checkpoint whose run config differs: the keys are named and nothing is chosen silently."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.debug_kill import kill_env
from tests.helpers.runs import REPO, STEP_RE, TINY_CKPT, run_env
from tests.helpers.runs import trainer as tiny_trainer
from titan.checkpointing.config_diff import differences, snapshot
from titan.checkpointing.lock import LOCK_NAME, RunLock, process_start
from titan.config import load_config
from titan.errors import TitanError


def _files(folder: Path) -> dict[str, float]:
    return {str(p.relative_to(folder)): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_second_run_on_same_folder_is_refused_and_writes_nothing(tmp_path):
    cmd = [
        sys.executable,
        "train.py",
        *TINY_CKPT,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "400",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "2",
    ]
    # the first run holds after step 5 until it is signalled: it cannot end while the second runs
    env = run_env(**kill_env("hold:step=5"))
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # the first run holds the lock and has saved checkpoints
            if (m := STEP_RE.search(line)) and int(m[1]) >= 5:
                break
        lock = json.loads((tmp_path / LOCK_NAME).read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname()
        os.kill(first.pid, signal.SIGSTOP)  # frozen: whatever changes in the folder now is the second run's
        before = _files(tmp_path)
        second = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
        after = _files(tmp_path)
        os.kill(first.pid, signal.SIGCONT)
        first.send_signal(signal.SIGTERM)
        rest = first.communicate(timeout=240)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith("titan: error")]
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert f"in use by another run (pid {first.pid} on {socket.gethostname()}, started " in errors[0], errors[0]
    assert after == before  # no step folder deleted or added, no metrics / TensorBoard file touched
    assert first.returncode == 0 and "received SIGTERM" in rest, rest[-3000:]
    assert not (tmp_path / LOCK_NAME).exists()  # released by the first run at its end


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"pid": dead.pid, "host": socket.gethostname(), "start_ticks": "1", "started": "earlier"})
    )
    lock = RunLock(str(tmp_path))
    lock.acquire()
    assert f"taking over the stale lock {tmp_path / LOCK_NAME}" in caplog.text and f"pid {dead.pid}" in caplog.text
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    # a live pid whose start time differs is a recycled pid: stale too
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "start_ticks": "x"}))
    assert process_start(1) not in (None, "x")
    RunLock(str(tmp_path)).acquire()
    # a lock from another host cannot be checked: refused, naming it and how to clear it
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 7, "host": "node-a", "start_ticks": "9", "started": "t"}))
    with pytest.raises(TitanError, match=r"in use by another run \(pid 7 on node-a, started t\).*delete"):
        RunLock(str(tmp_path)).acquire()


def test_release_removes_the_folders_the_lock_made_only_if_the_run_left_them_empty(tmp_path):
    refused = RunLock(str(tmp_path / "a" / "run"))
    refused.acquire()
    refused.release()  # a run that stopped before writing anything: nothing left behind
    assert list(tmp_path.iterdir()) == []
    ran = RunLock(str(tmp_path / "a" / "run"))
    ran.acquire()
    (tmp_path / "a" / "run" / "metrics.jsonl").write_text("{}")
    ran.release()
    assert [p.name for p in (tmp_path / "a" / "run").iterdir()] == ["metrics.jsonl"]
    existing = RunLock(str(tmp_path))  # a folder that was there before is never removed
    existing.acquire()
    existing.release()
    assert tmp_path.is_dir()


def test_training_relevant_keys_by_section():
    base = load_config([])
    changed = load_config(
        [
            "--optimizer.lr",
            "1e-3",
            "--lr_scheduler.warmup_steps",
            "7",
            "--training.steps",
            "9",
            "--metrics.log_freq",
            "3",
            "--checkpoint.interval",
            "5",
            "--job.dump_folder",
            "/else",
            "--optimizer.implementation",
            "for-loop",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ]
    )
    diff = differences(snapshot(base, 1), snapshot(changed, 1))
    assert diff == {"optimizer.lr": (8e-4, 1e-3), "lr_scheduler.warmup_steps": (200, 7)}
    # dp 1 -> 2 without a global batch doubles it: that is training-relevant
    assert differences(snapshot(base, 1), snapshot(base, 2)) == {"effective.global_batch": (8, 16)}


@pytest.mark.slow
def test_changed_lr_on_resume_error_use_new_use_checkpoint(tmp_path):
    steps = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
    tiny_trainer(tmp_path, *steps).train()
    with pytest.raises(TitanError, match=r"optimizer.lr = 0.003 there, 0.002 now.*config_mismatch use_checkpoint"):
        tiny_trainer(tmp_path, *steps, "--training.steps", "6", "--optimizer.lr", "2e-3")
    # use_new: today's lr really drives the optimizer after the checkpoint's state was loaded
    new = tiny_trainer(
        tmp_path, *steps, "--training.steps", "6", "--optimizer.lr", "2e-3", "--checkpoint.config_mismatch", "use_new"
    )
    ref = tiny_trainer(tmp_path / "ref", "--training.steps", "6", "--optimizer.lr", "2e-3")
    for _ in range(4):  # the uninterrupted lr schedule at lr 2e-3, at step 4
        ref.optimizers.step()
        ref.lr_schedulers.step()
    assert new.step == 4 and new.lr_schedulers.schedulers[0].base_lrs == [2e-3]
    assert new.lr_schedulers.get_last_lr() == pytest.approx(ref.lr_schedulers.get_last_lr())
    assert all(
        g["lr"] == pytest.approx(ref.lr_schedulers.get_last_lr()) for o in new.optimizers for g in o.param_groups
    )
    # use_checkpoint: the run continues with the checkpoint's lr
    old = tiny_trainer(
        tmp_path,
        *steps,
        "--training.steps",
        "6",
        "--optimizer.lr",
        "2e-3",
        "--checkpoint.config_mismatch",
        "use_checkpoint",
    )
    assert old.config.optimizer.lr == 3e-3 and old.lr_schedulers.schedulers[0].base_lrs == [3e-3]
