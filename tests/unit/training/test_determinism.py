"""training.deterministic: the settings it applies (and undoes), and on CUDA that it is bitwise:
two identical runs agree, and 10 steps + stop + resume equals 20 uninterrupted steps."""

from __future__ import annotations

import os

import pytest
import torch
import torch._inductor.config as inductor_config

from tests.helpers.runs import signal_during
from tests.helpers.runs import trainer as tiny_trainer
from titan.training.determinism import DeterministicMode


def _settings() -> tuple:
    b = torch.backends
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        b.cudnn.deterministic,
        b.cudnn.benchmark,
        inductor_config.deterministic,
        b.cuda.cudnn_sdp_enabled(),
        b.cuda.flash_sdp_enabled(),
        b.cuda.mem_efficient_sdp_enabled(),
        b.cuda.math_sdp_enabled(),
    )


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)


def test_apply_sets_every_switch_and_restore_undoes_it(clean_env) -> None:
    before = _settings()
    mode = DeterministicMode(True).apply()
    try:
        assert _settings() == (True, False, ":4096:8", True, False, True, False, True, True, True)
    finally:
        mode.restore()
    assert _settings() == before
    mode.restore()  # twice is harmless


def test_a_documented_cublas_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    mode = DeterministicMode(True).apply()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    mode.restore()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # not reproducible: replaced, then put back
    mode = DeterministicMode(True).apply()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    mode.restore()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":0:0"


def test_disabled_changes_nothing(clean_env) -> None:
    before = _settings()
    DeterministicMode(False).apply()
    assert _settings() == before


@pytest.mark.slow
def test_trainer_applies_it_before_the_device_and_restores_it(tmp_path, clean_env, monkeypatch) -> None:
    import titan.training.trainer

    seen = {}
    real_pick = titan.training.trainer.pick_device

    def pick_device(local_rank: int) -> torch.device:
        seen["env"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        return real_pick(local_rank)

    monkeypatch.setattr(titan.training.trainer, "pick_device", pick_device)
    before = _settings()
    trainer = tiny_trainer(tmp_path, "--training.deterministic", "--training.steps", "2")
    assert seen["env"] == ":4096:8"  # exported before the device was chosen (and CUDA touched)
    real_step = trainer.train_step

    def train_step(microbatches):
        seen["during"] = torch.are_deterministic_algorithms_enabled()
        return real_step(microbatches)

    trainer.train_step = train_step
    trainer.train()
    assert seen["during"] and _settings() == before

    failing = tiny_trainer(tmp_path / "failing", "--training.deterministic", "--training.steps", "2")

    def fail(microbatches):
        raise RuntimeError("step failed")

    failing.train_step = fail
    with pytest.raises(RuntimeError, match="step failed"):
        failing.train()
    assert _settings() == before  # a failed run gives them back too


# ---------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The debug-model run: seq 2048, batch 8 (it diverged from step 6 before).
GPU_RUN = ["--training.seq_len", "2048", "--training.local_batch_size", "8", "--training.deterministic"]


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in trainer.model_parts[0].state_dict().items()}


@cuda
@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--compile.enable"], ["--model.attn_type", "flex", "--compile.enable"]])
def test_cuda_two_identical_runs_are_bitwise_equal(tmp_path, extra: list[str]) -> None:
    runs = []
    for name in ("a", "b"):
        trainer = tiny_trainer(tmp_path / name, *GPU_RUN, "--training.steps", "10", *extra)
        assert trainer.device.type == "cuda"
        runs.append((trainer.train(), _params(trainer)))
    (losses_a, params_a), (losses_b, params_b) = runs
    assert sorted(losses_a) == list(range(1, 11))
    assert losses_a == losses_b
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a)


@cuda
@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_stop_and_resume_equals_the_uninterrupted_run(tmp_path) -> None:
    steps = [*GPU_RUN, "--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "10"]
    ref = tiny_trainer(tmp_path / "ref", *steps).train()
    first = tiny_trainer(tmp_path / "run", *steps)
    signal_during(first, 10, send=True)
    stopped = first.train()
    resumed = tiny_trainer(tmp_path / "run", *steps)
    assert resumed.step == 10
    assert sorted(ref) == list(range(1, 21))
    assert {**stopped, **resumed.train()} == ref  # every step, bitwise
