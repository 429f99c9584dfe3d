"""MoE routing statistics for the logs: load spread, padding and starvation per layer, the window
restarting at every log step, and the warning when an expert starves for several log steps."""

from __future__ import annotations

import logging

import pytest
import torch

from titan.models.moe import MoE, MoEArgs
from titan.training.moe import PER_LAYER_PREFIX, STARVED_LOG_STEPS, MoEMonitor


def test_log_tensors_and_starvation_warning(caplog):
    model = torch.nn.ModuleDict({"a": MoE(MoEArgs(num_experts=4), dim=16, hidden_dim=16)})
    monitor = MoEMonitor([model])
    moe = model["a"]
    moe.tokens_since_log.copy_(torch.tensor([6.0, 2.0, 0.0, 0.0]))
    moe.padded_since_log.fill_(2.0)
    values = {k: float(v) for k, v in monitor.log_tensors().items()}
    assert values[f"{PER_LAYER_PREFIX}a/tokens_max_over_mean"] == 3.0  # 6 over a mean of 2
    assert values[f"{PER_LAYER_PREFIX}a/padded_fraction"] == pytest.approx(0.2)  # 2 padding rows of 10
    assert values[f"{PER_LAYER_PREFIX}a/starved_experts"] == 2.0
    assert values["moe_max_load"] == 3.0 and values["moe_padded"] == pytest.approx(0.2)
    assert moe.tokens_since_log.sum() == 0 and moe.padded_since_log == 0  # a new window
    with caplog.at_level(logging.WARNING, logger="titan"):
        for step in range(1, STARVED_LOG_STEPS + 1):
            assert "got no token" not in caplog.text, step
            monitor.check(step * 10, values)
    assert f"MoE layer a: 2 expert(s) got no token at step {STARVED_LOG_STEPS * 10}" in caplog.text
    monitor.check(99, {**values, f"{PER_LAYER_PREFIX}a/starved_experts": 0.0})  # fed again: the count restarts
    assert monitor.starved_for["a"] == 0
