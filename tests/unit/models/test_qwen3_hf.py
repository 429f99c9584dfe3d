"""titan qwen3 <-> transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM: the same logits (within
1e-4, fp32) in both directions through HF folders, and every field of both config classes either
loads as exactly the same model or is refused in one line naming it."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub.errors import StrictDataclassFieldValidationError
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


# Each field of each config class, changed from its default (None: no value tried; the test
# fails when transformers adds a field not listed here).
CHANGES: dict[str, list[Any]] = {
    "vocab_size": [80],
    "hidden_size": [48],
    "intermediate_size": [56],
    "num_hidden_layers": [2],
    "num_attention_heads": [6],
    "num_key_value_heads": [4, None],
    "head_dim": [8],
    "hidden_act": ["gelu"],
    "max_position_embeddings": [128],
    "initializer_range": [0.5],
    "rms_norm_eps": [1e-2],
    "use_cache": [False],
    "tie_word_embeddings": [True],
    "rope_parameters": [
        {"rope_type": "default", "rope_theta": 300.0},
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    ],
    "attention_bias": [True],
    "use_sliding_window": [True],
    "sliding_window": [8],
    "max_window_layers": [1],
    "layer_types": [["full_attention", "sliding_attention", "full_attention"]],
    "attention_dropout": [0.1],
    "pad_token_id": [0],
    "bos_token_id": [1],
    "eos_token_id": [2, [2, 3]],
    "decoder_sparse_step": [2],
    "moe_intermediate_size": [16],
    "num_experts_per_tok": [1, 5],
    "num_experts": [3],
    "norm_topk_prob": [True],
    "output_router_logits": [True],
    "router_aux_loss_coef": [0.5],
    "mlp_only_layers": [[0, 2]],
}
REFUSED = {  # field -> the value titan refuses (the message names the field)
    "hidden_act": "gelu",
    "rope_parameters": ("yarn", "linear"),
    "attention_bias": True,
    "attention_dropout": 0.1,
    "output_router_logits": True,
}


def _fields(config_cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_cls) if f.name in config_cls.__annotations__]


@pytest.mark.parametrize("model_type", list(CLASSES))
def test_every_config_field_loads_exactly_or_is_refused(model_type: str) -> None:
    config_cls = CLASSES[model_type][0]
    fields = _fields(config_cls)
    assert set(fields) <= set(CHANGES), f"fields without a sweep value: {set(fields) - set(CHANGES)}"
    refused_seen = []
    for field in fields:
        for value in CHANGES[field]:
            extra = {"use_sliding_window": True} if field in ("sliding_window", "max_window_layers") else {}
            try:
                hf = _hf_model(model_type, **{field: value}, **extra)
            except (ValueError, KeyError, TypeError, StrictDataclassFieldValidationError):
                # transformers itself rejects the value for this class
                continue
            try:
                ours = _titan_logits(hf)
            except TitanError as e:
                assert field in str(e) or any(k in str(e) for k in extra), (field, value, str(e))
                assert "\n" not in str(e)
                refused_seen.append(field)
                continue
            with torch.no_grad():
                torch.testing.assert_close(ours, hf(TOKENS).logits, atol=1e-4, rtol=0, msg=f"{field}={value!r}")
    assert set(REFUSED) - {"output_router_logits"} <= set(refused_seen)
    assert model_type != "qwen3_moe" or "output_router_logits" in refused_seen


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
