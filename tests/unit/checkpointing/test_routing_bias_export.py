"""An HF export of an MoE family whose HF format has no routing bias (llama4, qwen3's MoE flavors,
gpt_oss) is exact or refused: a trained (non-zero) bias is refused unless the user accepts
dropping it, and the pre-process-group check refuses a last_save_in_hf run that trains one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.moe import EPTEST
from titan.checkpointing.hf import load_hf, save_hf
from titan.checkpointing.hf_check import check_routing_bias_export
from titan.config.sections.checkpoint import Checkpoint
from titan.errors import TitanError
from titan.models import get_flavor, get_model_spec
from titan.models.llama4.model import Llama4Transformer


def _trained_bias_model() -> Llama4Transformer:
    torch.manual_seed(0)
    model = Llama4Transformer(EPTEST)
    model.init_weights()
    model.layers["1"].moe.expert_bias.copy_(torch.tensor([0.01, -0.02, 0.0, 0.01]))
    return model


def test_a_trained_bias_is_refused_and_nothing_is_written(tmp_path) -> None:
    out = tmp_path / "hf"
    with pytest.raises(TitanError, match=r"layers\.1\.moe\.expert_bias is not zero .*--drop_routing_bias"):
        save_hf(_trained_bias_model().state_dict(), EPTEST, out)
    assert list(tmp_path.iterdir()) == []


def test_dropping_it_when_told_writes_the_rest_exactly(tmp_path) -> None:
    model = _trained_bias_model()
    save_hf(model.state_dict(), EPTEST, tmp_path / "hf", drop_routing_bias=True)
    state, _ = load_hf(tmp_path / "hf")
    for key, value in model.state_dict().items():
        if key.endswith("expert_bias"):
            assert torch.count_nonzero(state[key]) == 0  # HF has none: it reads back as no bias
        else:
            assert torch.equal(state[key], value), key


def test_a_zero_bias_exports_without_being_told(tmp_path) -> None:
    model = _trained_bias_model()
    model.layers["1"].moe.expert_bias.zero_()
    save_hf(model.state_dict(), EPTEST, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()


def test_the_run_check_refuses_last_save_in_hf_that_trains_a_dropped_bias() -> None:
    ckpt = Checkpoint(enable=True, last_save_model_only=True, last_save_in_hf=True)
    with pytest.raises(TitanError, match=r"^checkpoint\.last_save_in_hf: .*hf_drop_routing_bias = true"):
        check_routing_bias_export(ckpt, EPTEST)
    check_routing_bias_export(dataclasses.replace(ckpt, hf_drop_routing_bias=True), EPTEST)
    off = dataclasses.replace(EPTEST, moe_args=dataclasses.replace(EPTEST.moe_args, load_balance_coeff=None))
    check_routing_bias_export(ckpt, off)  # balancing off: the bias stays zero
    check_routing_bias_export(ckpt, get_flavor(get_model_spec("deepseek_v3"), "debugmodel"))  # HF DeepSeek-V3 keeps it
    check_routing_bias_export(ckpt, get_flavor(get_model_spec("qwen3"), "debugmodel"))  # dense: no routing
    check_routing_bias_export(dataclasses.replace(ckpt, last_save_in_hf=False), EPTEST)
