"""Steps that log nothing read nothing back from the device: every call that brings a tensor's value to
the host (item, tolist, float/int/bool/index of a tensor, cpu, numpy) made directly by titan's code is
counted per training step. The non-finite policy works without such reads: skip_step drops the update
on the device (weights and optimizer state bit-identical, step counter and LR schedule advanced) and
stop is reported at the next log step (or checkpoint save) naming the step where it happened."""

from __future__ import annotations

import collections
import copy
import math
import sys
from pathlib import Path

import pytest
import torch

import titan
from tests.helpers.inject import Inject
from tests.helpers.runs import trainer as tiny_trainer
from titan.errors import TitanError
from titan.training.nonfinite import UpdateMask
from titan.training.trainer import Trainer

TITAN = Path(titan.__file__).resolve().parent
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


class HostReads:
    """Patches the tensor methods in READS; a call whose caller is a file in titan/ is recorded
    as "path:line" under the trainer's current step."""

    def __init__(self, monkeypatch, trainer: Trainer) -> None:
        self.trainer = trainer
        self.by_step: dict[int, list[str]] = collections.defaultdict(list)
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, method):
        def counted(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(TITAN):
                self.by_step[self.trainer.step].append(f"{path.relative_to(TITAN.parent)}:{frame.f_lineno}")
            return method(tensor, *args, **kwargs)

        return counted


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Weights and every optimizer state tensor (moments, step counters), copied."""
    model = trainer.model_parts[0]
    [opt] = trainer.optimizers.optimizers
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            out[f"{n}.{key}"] = value.detach().clone()
    return out


def _record_before_steps(monkeypatch) -> dict[int, dict[str, torch.Tensor]]:
    """{step: weights and optimizer state entering that step}."""
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    original = Trainer.train_step

    def train_step(trainer, microbatches):
        snapshots[trainer.step] = _state(trainer)
        return original(trainer, microbatches)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    return snapshots


# A tiny llama4: its MoE block routes, counts tokens and moves its balancing bias on the device every
# step; its routing statistics join the log step's one read.
SMALL = ("--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4")
MOE = ("--model.name", "llama4", *SMALL)
# QK-clip tracks every head's largest logit every step and rescales on the device (a tiny threshold:
# every head is clipped); its statistics join the log step's one read.
QK_CLIP = (*SMALL, "--model.n_kv_heads", "2", "--optimizer.qk_clip_threshold", "0.01")


@pytest.mark.parametrize("model", [(), MOE, QK_CLIP], ids=["dense", "moe", "qk_clip"])
def test_no_host_read_on_steps_that_log_nothing(tmp_path, monkeypatch, model):
    trainer = tiny_trainer(tmp_path, "--training.steps", "11", "--metrics.log_freq", "5", *model)
    reads = HostReads(monkeypatch, trainer)
    losses = trainer.train()
    assert sorted(losses) == [1, 5, 10]
    quiet = [s for s in range(1, 12) if s not in losses]
    assert {s: reads.by_step[s] for s in quiet if s != 11 and reads.by_step[s]} == {}
    # a log step: one read for the loss, the grad norm, param_norm (steps 1 and 10) and the non-finite record
    assert all(len(reads.by_step[s]) == 1 for s in losses), dict(reads.by_step)
    # the last step logs nothing: training ends with one read of the non-finite record
    assert len(reads.by_step[11]) == 1, dict(reads.by_step)


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_skip_step_drops_the_update_on_the_device(tmp_path, monkeypatch, implementation, caplog):
    Inject(monkeypatch, {3}, grad_scale=math.nan)
    snapshots = _record_before_steps(monkeypatch)
    trainer = tiny_trainer(
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
    reads = HostReads(monkeypatch, trainer)
    losses = trainer.train()
    assert reads.by_step[3] == [] and reads.by_step[4] == []
    before, after = snapshots[3], snapshots[4]
    assert set(before) == set(after) and any(k.endswith(".exp_avg_sq") for k in before)
    for key in before:  # weights, both moments and the step counter: bit for bit
        assert torch.equal(before[key], after[key]), key
    assert not torch.equal(snapshots[2]["output.weight"], before["output.weight"])
    [opt] = trainer.optimizers.optimizers
    assert {int(s["step"]) for s in opt.state.values()} == {5}  # 6 steps, one skipped
    assert trainer.lr_schedulers.schedulers[0].last_epoch == 6  # the schedule kept going
    # reported at the next log step, naming the step
    assert trainer.stability.skipped_steps == 1 and sorted(losses) == [1, 5]
    assert "non-finite grad_norm = nan at step 3: optimizer step skipped (1 skipped so far, 0 in a row)" in caplog.text


def test_stop_is_reported_at_the_next_log_step(tmp_path, monkeypatch):
    Inject(monkeypatch, {2}, output_nan=True)
    trainer = tiny_trainer(tmp_path, "--training.steps", "8", "--metrics.log_freq", "4")
    reads = HostReads(monkeypatch, trainer)
    with pytest.raises(
        TitanError,
        match=r"non-finite loss = nan, grad_norm = nan at step 2 \(training.nonfinite = "
        r"stop\): stopping without saving.*\(found at step 4\)",
    ):
        trainer.train()
    assert reads.by_step[2] == [] and reads.by_step[3] == []


def test_stop_is_reported_before_a_checkpoint_save(tmp_path, monkeypatch):
    Inject(monkeypatch, {2}, output_nan=True)
    trainer = tiny_trainer(
        tmp_path,
        "--training.steps",
        "8",
        "--metrics.log_freq",
        "5",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "3",
    )
    with pytest.raises(TitanError, match=r"at step 2 \(training.nonfinite = stop\).*\(found at step 3\)"):
        trainer.train()
    assert not list((tmp_path / trainer.config.checkpoint.folder).glob("step-*"))


def test_too_many_skips_in_a_row_are_reported_at_the_next_log_step(tmp_path, monkeypatch):
    Inject(monkeypatch, {2, 3, 4}, grad_scale=math.nan)
    trainer = tiny_trainer(
        tmp_path,
        "--training.steps",
        "8",
        "--metrics.log_freq",
        "5",
        "--training.nonfinite",
        "skip_step",
        "--training.nonfinite_max_consecutive_skips",
        "2",
    )
    with pytest.raises(
        TitanError,
        match=r"grad_norm = nan at step 4: 3 consecutive steps skipped.*"
        r"max_consecutive_skips = 2 \(found at step 5\)",
    ):
        trainer.train()


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
def test_update_mask_keeps_or_drops_exactly(implementation):
    from titan.training.optim import IMPLEMENTATIONS

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, **IMPLEMENTATIONS[implementation])
    mask = UpdateMask([opt], torch.device("cpu"), enabled=True)

    def step(apply: bool) -> None:
        opt.zero_grad()
        model(torch.randn(3, 8)).square().sum().backward()
        with mask(torch.tensor(apply)):
            opt.step()

    def state() -> list[torch.Tensor]:
        return [t.clone() for p in model.parameters() for t in (p.detach(), *opt.state.get(p, {}).values())]

    step(False)  # the first step creates the optimizer state: a dropped one leaves a fresh state
    assert all(int(s["step"]) == 0 for s in opt.state.values())
    assert all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in opt.state.values())
    step(True)
    kept = state()
    step(False)
    assert all(torch.equal(a, b) for a, b in zip(kept, state()))
    # a kept step matches an optimizer that never saw the mask
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1, weight_decay=0.1, **IMPLEMENTATIONS[implementation])
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # not sharing the moments
    torch.manual_seed(5)
    step(True)
    torch.manual_seed(5)
    twin_opt.zero_grad()
    twin(torch.randn(3, 8)).square().sum().backward()
    twin_opt.step()
    assert torch.equal(model.weight, twin.weight) and torch.equal(model.bias, twin.bias)


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_post_step_hooks_see_the_restored_weights(implementation):
    from titan.training.optim import IMPLEMENTATIONS, OptimizersContainer

    model = torch.nn.Linear(4, 2)
    optimizers = OptimizersContainer([model], torch.optim.AdamW, {"lr": 0.1, **IMPLEMENTATIONS[implementation]})
    seen = []
    optimizers.register_step_post_hook(lambda: seen.append(model.weight.detach().clone()))  # e.g. float8 scales
    mask = UpdateMask(optimizers, torch.device("cpu"), enabled=True)
    before = model.weight.detach().clone()
    model(torch.randn(3, 4)).sum().mul(math.nan).backward()
    with mask(torch.tensor(False)):
        optimizers.step()
    assert torch.equal(seen[-1], before) and torch.equal(model.weight, before)


@pytest.mark.slow
def test_update_mask_with_torchao_bf16_stochastic_rounding():
    from titan.training.optim import _bf16_sr_adamw

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    opt = _bf16_sr_adamw()(model.parameters(), lr=0.1, weight_decay=0.1, bf16_stochastic_round=True)
    mask = UpdateMask([opt], torch.device("cpu"), enabled=True)
    for apply in (True, False):
        before = [model.weight.detach().clone(), *(t.clone() for t in opt.state.get(model.weight, {}).values())]
        opt.zero_grad()
        model(torch.randn(3, 8, dtype=torch.bfloat16)).float().square().sum().backward()
        with mask(torch.tensor(apply)):
            opt.step()
        after = [model.weight.detach(), *opt.state[model.weight].values()]
        assert all(torch.equal(a, b) for a, b in zip(before, after)) != apply
