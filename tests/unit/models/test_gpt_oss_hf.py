"""titan's gpt_oss against transformers' GptOssForCausalLM on random small configs, both ways: HF
weights loaded into titan and titan's exported into HF give the same logits (1e-4), the state
dict round trip is bitwise, and every GptOssConfig field is represented or refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from titan.errors import TitanError  # noqa: E402
from titan.models import spec_for_hf_model_type  # noqa: E402
from titan.models.gpt_oss.model import GptOssTransformer  # noqa: E402
from titan.models.gpt_oss.state_dict_adapter import (  # noqa: E402
    HF_DEFAULTS,
    HF_FIXED,
    HF_IGNORED,
    HF_MAPPED,
    args_to_hf_config,
    from_hf,
    hf_config_to_args,
    to_hf,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}  # fmt: skip
BASE = dict(num_hidden_layers=3, num_local_experts=4, vocab_size=97, hidden_size=48, intermediate_size=32, head_dim=16,
            num_attention_heads=4, num_key_value_heads=2, sliding_window=5, max_position_embeddings=64,
            num_experts_per_tok=2, rope_parameters=YARN)  # fmt: skip
VARIANTS = {
    "yarn_gqa": {},
    "truncated_yarn_attention_factor": {"rope_parameters": {**YARN, "truncate": True, "attention_factor": 1.3}},
    "plain_rope_mha_tied": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "num_key_value_heads": 4,
        "tie_word_embeddings": True,
    },
    "custom_layer_types_no_bias": {
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "attention_bias": False,
        "swiglu_limit": 0.3,
        "swiglu_alpha": 1.2,
    },
    # transformers cannot run sliding_window = None (its mask builder refuses it): all layers full instead.
    "all_full_head_dim_8": {"layer_types": ["full_attention"] * 3, "head_dim": 8},
}


def hf_model(**overrides) -> tuple[object, dict]:
    config = transformers.GptOssConfig(**{**BASE, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if "sinks" in name or "bias" in name else 0.1)
    return model, config.to_dict()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_both_ways(variant: str) -> None:
    hf, config = hf_model(**VARIANTS[variant])
    args = hf_config_to_args(config)
    assert spec_for_hf_model_type(config["model_type"]).name == "gpt_oss"
    model = GptOssTransformer(args)
    model.load_state_dict(from_hf(hf.state_dict(), args), strict=True)
    model.init_buffers(torch.device("cpu"))
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens, use_cache=False).logits, atol=1e-4, rtol=0)
    # titan -> HF: another titan model's weights, exported, in a model built from the exported config.
    torch.manual_seed(5)
    titan_model = GptOssTransformer(args)
    titan_model.init_weights()
    exported = to_hf(titan_model.state_dict(), args)
    hf_config = transformers.GptOssConfig(**args_to_hf_config(args))
    hf_config._attn_implementation = "eager"
    back = transformers.GptOssForCausalLM(hf_config).eval()
    missing, unexpected = back.load_state_dict(exported, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, use_cache=False).logits, titan_model(tokens), atol=1e-4, rtol=0)
    # The state dict round trip is bitwise; the config round trip gives the same args.
    again = from_hf(exported, args)
    for key, value in titan_model.state_dict().items():
        assert torch.equal(again[key], value), key
    assert hf_config_to_args(hf_config.to_dict()) == args


def test_every_config_field_is_accounted_for_and_absent_ones_are_transformers_defaults() -> None:
    """(Each field's values against transformers: tests/unit/models/test_hf_config_sweep.py.)"""
    base_fields = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    own = {f.name for f in dataclasses.fields(transformers.GptOssConfig)} - base_fields
    accounted = HF_MAPPED | HF_IGNORED | set(HF_FIXED)
    assert own <= accounted, sorted(own - accounted)
    default = transformers.GptOssConfig()
    for key, value in HF_DEFAULTS.items():
        if key != "rope_theta":
            assert getattr(default, key) == value, key
    assert type(default).default_theta == HF_DEFAULTS["rope_theta"]
    args = hf_config_to_args({"model_type": "gpt_oss"})
    assert args == hf_config_to_args(default.to_dict())
    assert (args.dim, args.n_layers, args.moe_args.num_experts, args.rope_factor) == (2880, 36, 128, 32.0)
    with pytest.raises(TitanError, match="sliding_window = None is not supported"):  # transformers needs one
        hf_config_to_args({**BASE, "sliding_window": None})


def test_sharded_folder_loads_in_transformers_and_back(tmp_path) -> None:
    """titan's HF writer (safetensors shards that split layers) -> from_pretrained gives the same
    logits; titan's reader gives back the same args and a bitwise state dict."""
    from titan.checkpointing.hf import load_hf, save_hf

    _, config = hf_model()
    args = hf_config_to_args(config)
    torch.manual_seed(2)
    model = GptOssTransformer(args)
    model.init_weights()
    save_hf(model.state_dict(), args, tmp_path, max_shard_bytes=20_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    state, loaded = load_hf(tmp_path)
    assert loaded == args and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens, use_cache=False).logits, model(tokens), atol=1e-4, rtol=0)
