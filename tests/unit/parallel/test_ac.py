"""Activation checkpointing: which blocks get wrapped, what gets recomputed, and exact gradients."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.tiny import TINY, batch, build
from titan.config import load_config
from titan.errors import TitanError
from titan.parallel.ac import apply_ac, parse_selective_option
from titan.parallel.init import canonical_fqn
from titan.training.checks import load_job
from titan.training.loss import cross_entropy_sum

FOUR = replace(TINY, n_layers=4)


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _grads_and_backward_mms(model):
    inputs, labels = batch(FOUR)
    loss = cross_entropy_sum(model(inputs), labels)
    with CountMatmuls() as counter:
        loss.backward()
    grads = {canonical_fqn(n): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, counter.count


@pytest.fixture(scope="module")
def eager():
    return _grads_and_backward_mms(build(FOUR))


# 7 Linear layers per block; backward does 2 matmuls per Linear (grad input, grad weight).
# Full AC re-runs the forward matmuls; the recompute stops early once everything backward needs
# exists, so the block's last matmul (w2, whose output nothing saves) is not re-run: 6 extra.
# "op" keeps the 1st, 3rd, 5th, 7th matmul outputs and re-runs only the 2nd, 4th, 6th: 3 extra.
@pytest.mark.parametrize(
    "mode, option, wrapped, extra_mms_per_wrapped_block",
    [
        ("full", "op", ["0", "1", "2", "3"], 6),
        ("selective", "op", ["0", "1", "2", "3"], 3),
        ("selective", "3", ["0", "3"], 6),
    ],
)
def test_ac_wraps_and_recomputes_as_claimed(eager, mode, option, wrapped, extra_mms_per_wrapped_block):
    model = build(FOUR)
    assert apply_ac(model, mode, option) == wrapped
    for name, block in model.layers.named_children():
        assert isinstance(block, CheckpointWrapper) == (name in wrapped), name
    loss, grads, mms = _grads_and_backward_mms(model)
    ref_loss, ref_grads, ref_mms = eager
    assert ref_mms == FOUR.n_layers * 14 + 2  # + the output projection
    assert mms - ref_mms == extra_mms_per_wrapped_block * len(wrapped)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


def test_none_leaves_model_alone():
    model = build(FOUR)
    before = copy.deepcopy(dict(model.layers.named_children()))
    assert apply_ac(model, "none") == []
    assert [type(b) for b in model.layers.values()] == [type(b) for b in before.values()]


@pytest.mark.parametrize("option", [0, -1, "ops", "two", True])
def test_bad_selective_option(option):
    with pytest.raises(TitanError, match="selective_ac_option"):
        parse_selective_option(option)


def test_config_is_validated_before_anything_runs():
    with pytest.raises(TitanError, match="activation_checkpoint.mode"):
        load_config(["--activation_checkpoint.mode", "partial"])
    with pytest.raises(TitanError, match="selective_ac_option"):
        load_job(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"])
    cfg = load_config(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"])
    assert cfg.activation_checkpoint.selective_ac_option == 2
