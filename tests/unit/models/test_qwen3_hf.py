"""titan qwen3 <-> transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM: the same logits (within
1e-4, fp32) in both directions through HF folders, and absent fields are transformers' defaults
(every field's values against transformers: tests/unit/models/test_hf_config_sweep.py)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from titan.checkpointing.hf import load_hf, read_hf_config, save_hf
from titan.errors import TitanError
from titan.models.moe import MoEArgs
from titan.models.qwen3 import Qwen3ModelArgs, Qwen3Transformer
from titan.models.qwen3.state_dict_adapter import (
    QWEN3_DEFAULTS,
    QWEN3_MOE_DEFAULTS,
    args_to_hf_config,
    from_hf,
    hf_config_to_args,
)

# head_dim 12 != hidden_size / heads (8): the head width is the model's own.
SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=64,
)
SMALL_MOE = dict(SMALL, moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2)
CLASSES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, SMALL),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, SMALL_MOE),
}
TOKENS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))


def _hf_model(model_type: str, **changes: Any) -> Any:
    config_cls, model_cls, small = CLASSES[model_type]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**small, **changes})).eval()
    with torch.no_grad():  # norms away from one, so a misplaced or unpermuted norm shows
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
    return model


def _titan_logits(hf_model: Any) -> torch.Tensor:
    args = hf_config_to_args(hf_model.config.to_dict())
    model = Qwen3Transformer(args)
    model.load_state_dict(from_hf(hf_model.state_dict(), args), strict=True)
    model.init_buffers()
    with torch.no_grad():
        return model(TOKENS)


@pytest.mark.parametrize(
    "model_type,changes",
    [
        ("qwen3", dict(tie_word_embeddings=True)),
        ("qwen3", dict(rope_parameters=dict(rope_type="llama3", rope_theta=5e4, factor=8.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=16))),
        ("qwen3_moe", dict(norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[2])),
        ("qwen3_moe", dict(norm_topk_prob=False)),
    ],
)  # fmt: skip
def test_hf_folder_both_ways_gives_transformers_logits(tmp_path: Path, model_type: str, changes: dict) -> None:
    hf = _hf_model(model_type, **changes)
    hf.save_pretrained(tmp_path / "hf")  # what transformers writes: per-expert tensors
    state, args = load_hf(tmp_path / "hf")
    model = Qwen3Transformer(args)
    model.load_state_dict(state, strict=True)
    model.init_buffers()
    with torch.no_grad():
        ref = hf(TOKENS).logits
        torch.testing.assert_close(model(TOKENS), ref, atol=1e-4, rtol=0)
    # titan -> HF folder -> transformers: the same logits, and the config reads back to the same args
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    save_hf(model.state_dict(), args, tmp_path / "out", max_shard_bytes=20_000)
    assert read_hf_config(tmp_path / "out") == args
    cls = CLASSES[model_type][1]
    back = cls.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS).logits, model(TOKENS), atol=1e-4, rtol=0)
    assert json.loads((tmp_path / "out/config.json").read_text())["model_type"] == model_type


@pytest.mark.parametrize("model_type,defaults", [("qwen3", QWEN3_DEFAULTS), ("qwen3_moe", QWEN3_MOE_DEFAULTS)])
def test_an_absent_field_takes_transformers_default(model_type: str, defaults: Any) -> None:
    config_cls = CLASSES[model_type][0]
    reference = config_cls()
    declared = {f.name: f.default for f in dataclasses.fields(config_cls)}
    for key, value in defaults.items():
        assert declared[key] == value, key
    # The smallest config.json: only its type. Same args as transformers' full default config.
    full = reference.to_dict()
    assert hf_config_to_args({"model_type": model_type}) == hf_config_to_args(full)
    # Qwen3-MoE has no head_dim field: its attention falls back to hidden_size / heads.
    if model_type == "qwen3_moe":
        assert hf_config_to_args({"model_type": model_type}).head_dim == 2048 // 32


def test_exports_refuse_what_transformers_cannot_express() -> None:
    args = Qwen3ModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, head_dim=8, hidden_dim=40, moe_enabled=True,
        moe_args=MoEArgs(num_experts=4, top_k=2, num_shared_experts=1, score_func="softmax", hidden_dim=16,
                         score_before_experts=False),
    )  # fmt: skip
    with pytest.raises(TitanError, match="num_shared_experts 1"):
        args_to_hf_config(args)
    sigmoid = copy.deepcopy(args)
    sigmoid.moe_args = dataclasses.replace(args.moe_args, num_shared_experts=0, score_before_experts=True)
    with pytest.raises(TitanError, match="score_before_experts false"):
        args_to_hf_config(sigmoid)
    with pytest.raises(TitanError, match="model_type is 'llama'"):
        hf_config_to_args({"model_type": "llama"})
