"""Garbage collection during training: off inside a run, collected every gc_freq steps, and the
interpreter's own setting back after the run, also after a run that raised."""

import gc
from pathlib import Path

import pytest

from titan.config import load_config
from titan.errors import TitanError
from titan.training.gc_handler import GarbageCollection

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def gc_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_off_inside_collects_every_freq_steps_and_restores(gc_enabled, monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation))
    with GarbageCollection(3) as collector:
        assert not gc.isenabled()
        for step in range(1, 8):
            collector.step(step)
    assert collected == [1, 1]  # steps 3 and 6
    assert gc.isenabled()


def test_restores_after_an_exception_and_keeps_a_disabled_setting(gc_enabled):
    with pytest.raises(RuntimeError, match="boom"):
        with GarbageCollection(1):
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()  # someone else turned it off before the run: it stays off after
    with GarbageCollection(1):
        pass
    assert not gc.isenabled()


def test_bad_frequency_names_the_key():
    with pytest.raises(TitanError, match="training.gc_freq"):
        GarbageCollection(0)


def _trainer(dump: Path):
    from titan.training.trainer import Trainer

    return Trainer(
        load_config(
            [
                "--job.config_file",
                str(REPO / "train_configs/debug_model.toml"),
                "--job.dump_folder",
                str(dump),
                "--training.seq_len",
                "32",
                "--training.local_batch_size",
                "2",
                "--training.steps",
                "2",
                "--training.gc_freq",
                "1",
                "--metrics.enable_tensorboard",
                "false",
            ]
        )
    )


@pytest.mark.slow
def test_trainer_gives_gc_back_after_a_run_and_after_a_failed_run(gc_enabled, tmp_path, monkeypatch):
    trainer = _trainer(tmp_path / "ok")
    seen = []
    step = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda mbs: (seen.append(gc.isenabled()), step(mbs))[1])
    trainer.train()
    assert seen == [False, False] and gc.isenabled()

    failing = _trainer(tmp_path / "failing")

    def fail(mbs):
        raise RuntimeError("step failed")

    monkeypatch.setattr(failing, "train_step", fail)
    with pytest.raises(RuntimeError, match="step failed"):
        failing.train()
    assert gc.isenabled()
