"""Commit marker, resume choice, keep_latest_k, signal flag, [checkpoint] checks, when to save."""

import logging
import signal
from pathlib import Path

import pytest

from tests.helpers.checkpoints import manager_for
from titan.checkpointing.folders import MARKER, pick_resume, prune, scan, write_marker
from titan.checkpointing.manager import CheckpointManager
from titan.checkpointing.preemption import PreemptionWatcher
from titan.checkpointing.states import ModelParts, TrainState
from titan.config import load_config
from titan.errors import TitanError

REPO = Path(__file__).resolve().parents[3]


def _step(root: Path, step: int, complete: bool, model_only: bool = False) -> None:
    d = root / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")  # a torn save can have DCP's metadata and all its files
    (d / "__0_0.distcp").write_bytes(b"x")
    if complete:
        write_marker(str(d), step, model_only=model_only, world_size=1, dp_degree=1)


def test_torn_step_skipped_with_warning(tmp_path, caplog):
    _step(tmp_path, 2, True)
    _step(tmp_path, 4, False)
    with caplog.at_level(logging.WARNING, logger="titan"):
        found = pick_resume(str(tmp_path), -1)
    assert found.step == 2 and found.complete
    assert any("step-4" in r.getMessage() and "incomplete" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "step-4" / (MARKER + ".tmp")).exists()


def test_load_step_and_exports(tmp_path):
    assert pick_resume(str(tmp_path / "absent"), -1) is None
    _step(tmp_path, 0, True, model_only=True)  # seed
    assert pick_resume(str(tmp_path), -1).step == 0
    _step(tmp_path, 3, True)
    _step(tmp_path, 5, False)
    _step(tmp_path, 6, True, model_only=True)  # final export: never resumed from
    assert pick_resume(str(tmp_path), -1).step == 3
    assert pick_resume(str(tmp_path), 3).step == 3
    with pytest.raises(TitanError, match="load_step 5: no complete checkpoint step-5"):
        pick_resume(str(tmp_path), 5)
    with pytest.raises(TitanError, match="load_step 9"):
        pick_resume(str(tmp_path), 9)


def test_keep_latest_k_never_deletes_last_complete_full(tmp_path):
    for step, complete, model_only in [
        (2, True, False),
        (3, False, False),
        (4, True, False),
        (6, True, True),
        (8, False, False),
    ]:
        _step(tmp_path, step, complete, model_only)
    prune(str(tmp_path), 0)  # 0 keeps everything
    assert len(scan(str(tmp_path))) == 5
    prune(str(tmp_path), 1)
    # 6 is the newest (an export), 4 the newest full one; torn 3 is garbage; torn 8 may be in flight
    assert [(f.step, f.complete) for f in scan(str(tmp_path))] == [(4, True), (6, True), (8, False)]


def test_prune_interrupted_mid_delete_leaves_a_torn_folder(tmp_path, monkeypatch):
    """A kill while pruning must never leave a folder marked complete with files missing."""
    for step in (2, 4):
        _step(tmp_path, step, True)

    def killed(path, ignore_errors=False):  # the process dies after the first file is gone
        raise SystemExit("killed")

    monkeypatch.setattr("titan.checkpointing.folders.shutil.rmtree", killed)
    with pytest.raises(SystemExit):
        prune(str(tmp_path), 1)
    assert [(f.step, f.complete) for f in scan(str(tmp_path))] == [(2, False), (4, True)]
    monkeypatch.undo()
    prune(str(tmp_path), 1)  # the torn leftover is garbage next time
    assert [(f.step, f.complete) for f in scan(str(tmp_path))] == [(4, True)]


def test_signal_sets_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    watcher = PreemptionWatcher(group=None)
    watcher.install()
    try:
        assert not watcher.should_stop()
        signal.raise_signal(signal.SIGUSR1)
        assert watcher.should_stop()
    finally:
        watcher.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_checkpoint_config():
    c = load_config(["--checkpoint.enable", "--checkpoint.exclude_from_loading", "dataloader,optimizer"])
    assert c.checkpoint.enable and c.checkpoint.exclude_from_loading == ["dataloader", "optimizer"]
    for args, key in [
        (["--checkpoint.async_mode", "thread"], "checkpoint.async_mode"),
        (["--checkpoint.export_dtype", "int8"], "checkpoint.export_dtype"),
        (["--checkpoint.exclude_from_loading", "model,weights"], "checkpoint.exclude_from_loading"),
        (["--checkpoint.interval", "0"], "checkpoint.interval"),
        (["--checkpoint.keep_latest_k", "-1"], "checkpoint.keep_latest_k"),
    ]:
        with pytest.raises(TitanError, match=key):
            load_config(args)
    with pytest.raises(TitanError, match="'checkpoint.initial_load_path' needs checkpoint.enable"):
        load_config(["--checkpoint.initial_load_path", "/some/step-10"])


def test_seed_checkpoint_needs_one_process():
    config = load_config(["--checkpoint.create_seed_checkpoint"])
    with pytest.raises(TitanError, match="create_seed_checkpoint needs 1 process"):
        _manager(config, world_size=2)


def _manager(config, **facts) -> CheckpointManager:
    return manager_for(config, {"model": ModelParts([]), "train_state": TrainState()}, {}, **facts)


def test_should_save_every_interval_and_the_last_step(tmp_path):
    config = load_config(
        [
            "--checkpoint.enable",
            "--checkpoint.interval",
            "4",
            "--training.steps",
            "10",
            "--job.dump_folder",
            str(tmp_path),
        ]
    )
    manager = _manager(config)
    assert [s for s in range(1, 11) if manager.should_save(s)] == [4, 8, 10]
    assert [manager.next_save(s) for s in (0, 3, 4, 8, 9)] == [4, 4, 8, 10, 10]
    off = _manager(load_config(["--checkpoint.interval", "4", "--training.steps", "10"]))
    assert not any(off.should_save(s) for s in range(1, 11))
