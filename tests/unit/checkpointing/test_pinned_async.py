"""checkpoint.async_mode = async_with_pinned_mem saves many times in one run and resumes exactly.

The CUDA failure (every second save died with ``<class 'type'>``) was the reused stager
being closed after the first upload; a closed stager fails its next copy with KeyError(type).
These tests save 4 times in one run, also under a DCP that closes the stager it was given after
each upload, and check the message of a save that does fail names the exception and its cause.
"""

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import state_dict_saver

from tests.helpers.runs import trainer as tiny_trainer
from titan.errors import TitanError

PINNED = [
    "--training.steps",
    "8",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.async_mode",
    "async_with_pinned_mem",
    "--checkpoint.keep_latest_k",
    "0",
]  # keep all 4


def _committed(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoint").glob("step-*") if (p / "COMPLETE").is_file())


def _closing_async_save(monkeypatch) -> None:
    """Act like a torch release that closes the caller's stager once each upload is done."""
    real = state_dict_saver.async_save

    def async_save(state, *args, async_stager=None, **kwargs):
        result = real(state, *args, async_stager=async_stager, **kwargs)
        result.upload_completion.add_done_callback(lambda _: async_stager.close())
        return result

    monkeypatch.setattr(state_dict_saver, "async_save", async_save)


def _saves_and_resumes(tmp_path: Path, monkeypatch, exact: bool) -> None:
    _closing_async_save(monkeypatch)
    ref = tiny_trainer(tmp_path / "ref", *PINNED).train()
    assert sorted(ref) == list(range(1, 9))
    assert _committed(tmp_path / "ref") == ["step-2", "step-4", "step-6", "step-8"]
    (tmp_path / "run/checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "ref/checkpoint/step-4", tmp_path / "run/checkpoint/step-4")
    resumed = tiny_trainer(tmp_path / "run", *PINNED)
    assert resumed.step == 4
    losses = resumed.train()
    assert sorted(losses) == [5, 6, 7, 8]
    if exact:
        assert losses == {s: ref[s] for s in losses}  # bitwise (CPU fp32)
    else:
        assert all(abs(losses[s] - ref[s]) < 1e-2 * abs(ref[s]) for s in losses), (losses, ref)


@pytest.mark.slow
def test_pinned_async_four_saves_then_exact_resume_cpu(tmp_path, monkeypatch):
    _saves_and_resumes(tmp_path, monkeypatch, exact=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned memory, non-blocking copies)")
def test_pinned_async_four_saves_then_resume_cuda(tmp_path, monkeypatch):
    _saves_and_resumes(tmp_path, monkeypatch, exact=False)


@pytest.mark.slow
def test_failed_pinned_save_names_exception_and_cause(tmp_path, monkeypatch):
    from titan.checkpointing import staging

    def released(self):  # the stager a torch release closed behind our back, not rebuilt
        inner = staging.DefaultStager(staging.staging_options())
        inner._state_dict_stager.close()  # its copier's dispatch table is emptied
        return inner

    monkeypatch.setattr(staging.OwnedStager, "_live", released)
    trainer = tiny_trainer(tmp_path / "run", *PINNED)
    with pytest.raises(TitanError) as info:
        trainer.train()
    message = str(info.value)
    assert "checkpoint step 2: writing" in message and "step-2 failed: KeyError: <class 'type'>" in message, message
    assert "staging buffers were released" in message, message
    assert not (tmp_path / "run/checkpoint/step-2").exists()
