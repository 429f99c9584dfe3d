"""The non-finite policy on the GPU without a host sync: steps that log nothing run under
torch.cuda.set_sync_debug_mode("error") (any device-to-host read or synchronisation raises), a NaN loss
on such a step leaves the weights and the optimizer state bit-identical with skip_step (step counter
and LR schedule advanced), and stop is reported at the next log step naming the step."""

import math

import pytest
import torch

from tests.cuda._common import gpu_config
from titan.errors import TitanError
from titan.training.trainer import Trainer

pytestmark = pytest.mark.cuda
QUIET = {2, 3, 4}  # log_freq 5: steps that log nothing


def _run(monkeypatch, trainer: Trainer, nan_step: int) -> dict[int, dict[str, torch.Tensor]]:
    """Train with a NaN model output (so a NaN loss and NaN gradients) at ``nan_step`` and every step in
    QUIET under the sync-debug "error" mode; returns the weights and optimizer state entering each step."""
    entering: dict[int, dict[str, torch.Tensor]] = {}
    original = Trainer.train_step

    def train_step(self, microbatches):
        entering[self.step] = _state(self)
        model = self.model_parts[0]
        handles = [model.register_forward_hook(lambda m, i, out: out * math.nan)] if self.step == nan_step else []
        # The batch is already on the device (next_microbatches); its host-to-device copy is non-blocking.
        torch.cuda.set_sync_debug_mode("error" if self.step in QUIET else "default")
        try:
            return original(self, microbatches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for h in handles:
                h.remove()

    monkeypatch.setattr(Trainer, "train_step", train_step)
    trainer.train()
    return entering


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    [opt] = trainer.optimizers.optimizers
    out = {}
    for name, p in trainer.model_parts[0].named_parameters():
        out[name] = p.detach().clone()
        for key, value in opt.state.get(p, {}).items():
            out[f"{name}.{key}"] = value.detach().clone()
    return out


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_nan_loss_skips_the_update_on_the_device(tmp_path, monkeypatch, implementation):
    trainer = Trainer(
        gpu_config(
            tmp_path,
            "--training.steps",
            "6",
            "--metrics.log_freq",
            "5",
            "--training.nonfinite",
            "skip_step",
            "--optimizer.implementation",
            implementation,
        )
    )
    entering = _run(monkeypatch, trainer, nan_step=3)
    before, after = entering[3], entering[4]
    assert set(before) == set(after) and any(k.endswith(".exp_avg") for k in before)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert not torch.equal(entering[2]["output.weight"], before["output.weight"])
    [opt] = trainer.optimizers.optimizers
    assert {int(s["step"]) for s in opt.state.values()} == {5}  # 6 steps, one skipped
    assert trainer.lr_schedulers.schedulers[0].last_epoch == 6
    assert trainer.stability.skipped_steps == 1


def test_stop_reports_at_the_next_log_step(tmp_path, monkeypatch):
    trainer = Trainer(gpu_config(tmp_path, "--training.steps", "6", "--metrics.log_freq", "5"))
    with pytest.raises(
        TitanError,
        match=r"non-finite loss = nan, grad_norm = nan at step 3 \(training.nonfinite = "
        r"stop\).*\(found at step 5\)",
    ):
        _run(monkeypatch, trainer, nan_step=3)
