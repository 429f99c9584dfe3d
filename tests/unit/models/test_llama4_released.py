"""Meta's Llama 4 as released, against transformers' Llama4ForCausalLM: the text configs of
Llama-4-Scout-17B-16E and Llama-4-Maverick-17B-128E load with every released feature (QK L2 norm,
attention temperature tuning, NoPE every 4th block from block 3, chunked attention, MoE every
block or every second block), the full-size model has transformers' tensors (meta device), the
same configs shrunk compute transformers' logits both ways, and every Llama4TextConfig field
changed from its value loads exactly or is refused in one line naming it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig, PreTrainedConfig

from titan.errors import TitanError
from titan.models.llama4 import Llama4Transformer
from titan.models.llama4.hf_config import HF_DEFAULT_ROPE_THETA, HF_DEFAULTS, IGNORED_FIELDS
from titan.models.llama4.state_dict_adapter import (
    args_to_hf_config,
    from_hf,
    hf_config_to_args,
    state_dict_shapes,
    to_hf,
)

# The text part of the released config.json files (meta-llama/Llama-4-Scout-17B-16E and
# meta-llama/Llama-4-Maverick-17B-128E on the Hugging Face hub).
_COMMON: dict[str, Any] = {
    "model_type": "llama4_text",
    "attention_bias": False,
    "attention_chunk_size": 8192,
    "attention_dropout": 0.0,
    "attn_scale": 0.1,
    "attn_temperature_tuning": True,
    "bos_token_id": 200000,
    "eos_token_id": [200001, 200007, 200008],
    "floor_scale": 8192,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "no_rope_layers": [],
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "output_router_logits": False,
    "pad_token_id": 200018,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "use_cache": True,
    "vocab_size": 202048,
}
SCOUT = {
    **_COMMON,
    "interleave_moe_layer_step": 1,
    "max_position_embeddings": 10485760,
    "num_local_experts": 16,
    "rope_scaling": {
        "factor": 16.0,
        "high_freq_factor": 1.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "use_qk_norm": True,
}
MAVERICK = {
    **_COMMON,
    "interleave_moe_layer_step": 2,
    "max_position_embeddings": 1048576,
    "moe_layers": list(range(1, 48, 2)),
    "num_local_experts": 128,
    "rope_scaling": None,
    "use_qk_norm": False,
}
# The same features at test size: 8 blocks (NoPE at 3 and 7), chunks of 4, temperature from position 3.
SHRINK = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
    intermediate_size_mlp=48, num_hidden_layers=8, vocab_size=128, num_local_experts=4, attention_chunk_size=4,
    floor_scale=4, attn_scale=0.5, max_position_embeddings=64, pad_token_id=None, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
SEQ = 24


def _hf_config(raw: dict[str, Any]) -> Llama4TextConfig:
    raw = {k: v for k, v in raw.items() if k != "model_type"}
    rope = raw.pop("rope_scaling", None)
    if rope is not None or "rope_theta" in raw:
        raw["rope_parameters"] = {"rope_type": "default", **(rope or {}), "rope_theta": raw.pop("rope_theta")}
    return Llama4TextConfig(**raw)


def _hf_model(raw: dict[str, Any]) -> Llama4ForCausalLM:
    torch.manual_seed(0)
    model = Llama4ForCausalLM(_hf_config(raw)).eval()
    with torch.no_grad():  # every tensor away from its init (norm weights near 1), so every one matters
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.15)
    return model


def _titan_from(hf: Llama4ForCausalLM, raw: dict[str, Any]) -> Llama4Transformer:
    args = hf_config_to_args(raw)
    model = Llama4Transformer(args)
    model.init_buffers()
    model.load_state_dict(from_hf(hf.state_dict(), args))
    return model.eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _logits_gap(raw: dict[str, Any]) -> float:
    hf = _hf_model(raw)
    model = _titan_from(hf, raw)
    tokens = _tokens(hf.config.vocab_size)
    with torch.no_grad():
        return float((model(tokens) - hf(tokens).logits).abs().max())


def test_hf_defaults_are_transformers_own():
    fields = {f.name: f.default for f in dataclasses.fields(Llama4TextConfig)}
    assert {k: fields[k] for k in HF_DEFAULTS} == HF_DEFAULTS
    assert Llama4TextConfig.default_theta == HF_DEFAULT_ROPE_THETA


@pytest.mark.parametrize("name,raw", [("scout", SCOUT), ("maverick", MAVERICK)])
def test_released_configs_load_with_every_feature_and_transformers_shapes(name, raw):
    args = hf_config_to_args(raw)
    nope = list(range(3, 48, 4))
    assert [i for i in range(48) if not args.uses_rope(i)] == nope
    assert [i for i in range(48) if args.is_chunked(i)] == [i for i in range(48) if i not in nope]
    moe = list(range(48)) if name == "scout" else list(range(1, 48, 2))
    assert [i for i in range(48) if args.is_moe_layer(i)] == moe
    assert args.use_qk_norm == (name == "scout") and args.attn_temperature_tuning
    assert (args.floor_scale, args.attn_scale, args.fixed_attn_block_size) == (8192, 0.1, 8192)
    assert args.use_rope_scaling == (name == "scout") and args.moe_args.num_experts == raw["num_local_experts"]
    with torch.device("meta"):
        hf = Llama4ForCausalLM(_hf_config(raw))
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    shapes = state_dict_shapes(args)  # the routing bias aside: HF has none
    titan = {k: torch.empty(s, device="meta") for k, s in shapes.items() if not k.endswith("expert_bias")}
    assert {k: tuple(v.shape) for k, v in to_hf(titan, args).items()} == hf_shapes
    back = args_to_hf_config(args)  # and the export writes what transformers resolves the file to
    resolved = _hf_config(raw)
    for key in ("no_rope_layers", "layer_types", "moe_layers", "use_qk_norm", "attn_temperature_tuning"):
        assert back[key] == getattr(resolved, key), key


@pytest.mark.parametrize("raw", [SCOUT, MAVERICK], ids=["scout", "maverick"])
def test_released_features_give_transformers_logits_both_ways(raw):
    small = {**raw, **SHRINK}
    small["moe_layers"] = [1, 3, 5, 7] if "moe_layers" in raw else None
    if raw["rope_scaling"]:
        small["rope_scaling"] = {**raw["rope_scaling"], "original_max_position_embeddings": 16}
    hf = _hf_model(small)
    model = _titan_from(hf, small)
    args = model.model_args
    assert args.use_qk_norm == raw["use_qk_norm"] and args.nope_layers == [3, 7]
    tokens = _tokens(128)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
        # export: titan's config.json and weights -> transformers again, same logits
        config = {k: v for k, v in args_to_hf_config(args).items() if k not in ("architectures", "model_type")}
        config.pop("torch_dtype")
        again = Llama4ForCausalLM(Llama4TextConfig(**config)).eval()
        again.load_state_dict(to_hf(model.state_dict(), args))
        torch.testing.assert_close(again(tokens).logits, theirs, atol=1e-4, rtol=0)
        # the released features matter at this size: without them the logits move far beyond 1e-4
        for off in ({"use_qk_norm": False} if raw["use_qk_norm"] else {}, {"attn_temperature_tuning": False}):
            if off:
                plain = Llama4Transformer(dataclasses.replace(args, **off))
                plain.init_buffers()
                plain.load_state_dict(model.state_dict())
                assert float((plain(tokens) - theirs).abs().max()) > 1e-2, off


BASE: dict[str, Any] = {"model_type": "llama4_text", **SHRINK, "num_hidden_layers": 4, "no_rope_layer_interval": 2}
# One changed value per Llama4TextConfig field (BASE's value, else transformers' default, changed).
CHANGED: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 128, "intermediate_size": 40, "intermediate_size_mlp": 96,
    "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "hidden_act": "gelu", "max_position_embeddings": 48, "initializer_range": 0.05, "rms_norm_eps": 1e-3,
    "use_cache": False, "pad_token_id": 0, "bos_token_id": 5, "eos_token_id": 6, "tie_word_embeddings": True,
    "attention_dropout": 0.1, "num_experts_per_tok": 2, "num_local_experts": 3, "moe_layers": [1, 3],
    "interleave_moe_layer_step": 2, "use_qk_norm": False, "output_router_logits": True,
    "router_aux_loss_coef": 0.01, "router_jitter_noise": 0.1,
    "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "no_rope_layers": [0, 1, 1, 0], "no_rope_layer_interval": 3, "attention_chunk_size": 8,
    "layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention"],
    "attn_temperature_tuning": False, "floor_scale": 2, "attn_scale": 0.3, "attention_bias": True,
}  # fmt: skip
REFUSED = {"hidden_size", "num_attention_heads", "head_dim", "hidden_act", "attention_dropout", "attention_bias"}


def test_every_llama4_text_config_field_is_swept():
    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    own = {f.name for f in dataclasses.fields(Llama4TextConfig)} - base
    assert own <= set(CHANGED), sorted(own - set(CHANGED))
    assert IGNORED_FIELDS <= set(CHANGED)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_field_changed_loads_exactly_or_is_refused_naming_it(field):
    raw = {**BASE, field: CHANGED[field]}
    if field in REFUSED:
        with pytest.raises(TitanError, match=field) as e:
            hf_config_to_args(raw)
        assert "\n" not in str(e.value)
        return
    assert _logits_gap(raw) <= 1e-5


def test_absent_fields_take_transformers_defaults_and_layouts_titan_can_express():
    # without use_qk_norm / attn_temperature_tuning: transformers' default true, honoured
    raw = {k: v for k, v in BASE.items()}
    args = hf_config_to_args(raw)
    assert args.use_qk_norm and args.attn_temperature_tuning
    assert _logits_gap(raw) <= 1e-5
    # an explicit layer_types that disagrees with no_rope_layers: RoPE follows no_rope_layers,
    # the mask follows layer_types, block by block, as in transformers
    types = ["chunked_attention"] * 2 + ["full_attention"] * 2
    odd = {**BASE, "no_rope_layers": [1, 0, 1, 0], "layer_types": types}
    args = hf_config_to_args(odd)
    assert args.nope_layers == [1, 3] and args.chunked_layers == [0, 1]
    assert _logits_gap(odd) <= 1e-5
    # temperature tuning with no NoPE block: accepted, no effect
    all_rope = {**BASE, "no_rope_layers": [1, 1, 1, 1], "attn_temperature_tuning": True}
    assert hf_config_to_args(all_rope).nope_layers is None and _logits_gap(all_rope) <= 1e-5
    # moe_layers [1, 3] with interleave step 1: MoE every second block
    moe = {**BASE, "moe_layers": [1, 3], "interleave_moe_layer_step": 1}
    assert hf_config_to_args(moe).interleave_moe_layer_step == 2 and _logits_gap(moe) <= 1e-5
    # a layout only a block list expresses
    sparse = {**BASE, "moe_layers": [0, 3]}
    assert hf_config_to_args(sparse).moe_layers == [0, 3] and _logits_gap(sparse) <= 1e-5


def test_refusals_are_one_line_and_name_the_field():
    cases = {
        "layer_types": {"layer_types": ["sliding_attention"] * 4},
        "attention_chunk_size": {"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 4},
        "rope_type = 'yarn'": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
        "no_rope_layers": {"no_rope_layers": [1, 1]},
    }
    for needle, change in cases.items():
        with pytest.raises(TitanError, match=needle) as e:
            hf_config_to_args({**BASE, **change})
        assert "\n" not in str(e.value)
