"""titan deepseek_v3 <-> transformers' DeepseekV3ForCausalLM: logits within 1e-4 (fp32) both ways on
random small configs (YaRN with both mscales, low-rank and plain queries, group-limited routing
with a non-zero correction bias), lossless weights, and every DeepseekV3Config field either read,
refused in one line, or without effect on the logits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from titan.errors import TitanError
from titan.models.deepseek_v3.args import DeepSeekV3ModelArgs, deepseek_v3_configs
from titan.models.deepseek_v3.model import DeepSeekV3Transformer
from titan.models.deepseek_v3.state_dict_adapter import (
    HF_FIELDS,
    TRANSFORMERS_DEFAULTS,
    args_to_hf_config,
    from_hf,
    hf_config_to_args,
    to_hf,
)
from titan.models.moe import MoEArgs

SMALL = dict(
    vocab_size=96, hidden_size=48, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.7,
    kv_lora_rank=24,
    qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
    first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-5,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
HF_CONFIGS = {
    "yarn_mscales_q_lora": dict(SMALL, q_lora_rank=20, rope_parameters=dict(YARN, mscale=0.8, mscale_all_dim=0.6)),
    "yarn_plain_wq_tied": dict(SMALL, q_lora_rank=None, tie_word_embeddings=True, rope_parameters=dict(YARN)),
    "default_rope_no_groups": dict(
        SMALL, q_lora_rank=20, n_group=1, topk_group=1, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    ),
}  # fmt: skip


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name or not t.is_floating_point() or "tokens_" in name or "padded" in name:
                continue
            if "freqs" in name:
                continue
            base = 1.0 if "norm" in name or "layernorm" in name else 0.0
            t.copy_(base + 0.2 * torch.randn(t.shape, generator=g))


def _hf_model(config: dict) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**config, attn_implementation="eager")).eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_to_titan_logits_and_weights(name):
    hf = _hf_model(HF_CONFIGS[name])
    _randomize(hf, 3)
    if hf.config.tie_word_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    args = hf_config_to_args(hf.config.to_dict())
    model = DeepSeekV3Transformer(args)
    model.init_buffers(torch.device("cpu"))
    state = from_hf(hf.state_dict(), args)
    missing = set(model.state_dict()) - set(state)
    assert not missing, missing
    model.load_state_dict(state)
    tokens = _tokens(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    back = to_hf(model.state_dict(), args)
    for key, value in back.items():
        assert torch.equal(value, hf.state_dict()[key]), key


TITAN_ARGS = {
    "groups_sigmoid": DeepSeekV3ModelArgs(
        vocab_size=80, dim=32, inter_dim=48, moe_inter_dim=16, n_layers=3, n_dense_layers=1, n_heads=2,
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, latent_norm_eps=1e-6,
        max_seq_len=48, original_seq_len=16, rope_factor=3.0, mscale=0.7, rope_attention_factor=1.1,
        moe_args=MoEArgs(num_experts=6, num_shared_experts=2, top_k=2, score_func="sigmoid", route_norm=True,
                         route_scale=2.5, score_before_experts=False, num_expert_groups=3, num_limited_groups=2),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TITAN_ARGS))
def test_titan_to_hf_logits_and_config_round_trip(name):
    args = TITAN_ARGS[name]
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(dataclasses.replace(args))
    model.init_weights()
    _randomize(model, 4)
    config = args_to_hf_config(args)
    hf = _hf_model({k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})
    result = hf.load_state_dict(to_hf(model.state_dict(), args), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    tokens = _tokens(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    back = hf_config_to_args(hf.config.to_dict())
    assert dataclasses.replace(back, use_yarn=None) == args  # the export states what the args derived


def test_every_config_field_is_accounted_for_with_transformers_default():
    """(Each field's values against transformers: tests/unit/models/test_hf_config_sweep.py.)"""
    fields = {f.name for f in dataclasses.fields(DeepseekV3Config)} - {
        f.name for f in dataclasses.fields(DeepseekV3Config.__mro__[1])
    }
    assert set(HF_FIELDS) == fields == set(TRANSFORMERS_DEFAULTS)
    for field in fields:
        default = getattr(DeepseekV3Config, field, None)
        assert TRANSFORMERS_DEFAULTS[field] == default or field == "rope_parameters", field
    for field, how in HF_FIELDS.items():  # a refused field takes only its default
        if how == "refused":
            with pytest.raises(TitanError, match=field):
                hf_config_to_args({**SMALL, "q_lora_rank": 20, field: "other"})


def test_absent_fields_are_transformers_defaults():
    args = hf_config_to_args({"model_type": "deepseek_v3"})
    flavor = deepseek_v3_configs["671B"]
    for key in ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads", "n_dense_layers",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):  # fmt: skip
        assert getattr(args, key) == getattr(flavor, key), key
    moe = dataclasses.replace(args.moe_args, hidden_dim=None)
    assert moe == flavor.moe_args


def test_export_refuses_softmax_routing_in_one_line():
    with pytest.raises(TitanError, match="sigmoid"):
        args_to_hf_config(deepseek_v3_configs["16B"])


def test_hf_folder_written_by_titan_loads_in_transformers(tmp_path):
    from titan.checkpointing.hf import load_hf, save_hf

    args = TITAN_ARGS["groups_sigmoid"]
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(dataclasses.replace(args))
    model.init_weights()
    _randomize(model, 5)
    save_hf(model.state_dict(), model.model_args, tmp_path / "hf", max_shard_bytes=40_000)  # built args; several files
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    tokens = _tokens(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=1e-4)
    state, back_args = load_hf(tmp_path / "hf")
    assert dataclasses.replace(back_args, use_yarn=None) == args
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key


def test_released_config_json_reads_as_the_671b_flavor_with_yarn():
    """deepseek-ai/DeepSeek-V3's config.json spelling (rope_scaling with "type", legacy keys beside)."""
    released = {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "rope_theta": 10000,
        "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "moe_layer_freq": 1, "ep_size": 1,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    }  # fmt: skip
    args = hf_config_to_args(released)
    flavor = deepseek_v3_configs["671B"]
    assert (args.dim, args.n_layers, args.n_heads, args.q_lora_rank) == (flavor.dim, 61, 128, 1536)
    assert args.use_yarn and (args.rope_factor, args.original_seq_len, args.mscale) == (40.0, 4096, 1.0)
    assert args.rope_attention_factor == 1.0  # mscale / mscale_all_dim: the table is unscaled, as torchtitan's
    assert args.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
