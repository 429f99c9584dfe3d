"""Every config.json field of every family titan reads, against transformers (tests/helpers/hf_sweep.py):
each field changed alone, left out or null, and RoPE spelled every way transformers takes it, loads as
the model transformers runs (logits within 1e-4) or is refused in one line; a folder whose tensors
contradict its config.json is refused before anything is written; and titan's model args, each field
changed alone, export to a folder that transformers runs as the same model or are refused."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.hf_sweep import ABSENT, HfFamily, Outcome, failures, sweep_export, sweep_import
from titan.models import spec_for_hf_model_type

transformers = pytest.importorskip("transformers")

DEFAULT = {"rope_type": "default", "rope_theta": 1e4}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.6}  # fmt: skip
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 8}  # fmt: skip
OTHER_ROPES = ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
               {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})  # fmt: skip
# Fields every family has: token ids, caching and init change nothing titan computes; the others must.
COMMON = {
    "vocab_size": (80,), "initializer_range": (0.5,), "rms_norm_eps": (1e-2,), "use_cache": (False,),
    "tie_word_embeddings": (True,), "pad_token_id": (0,), "bos_token_id": (1,), "eos_token_id": (2, [2, 3]),
    "attention_dropout": (0.1,), "hidden_act": ("gelu",), "max_position_embeddings": (24, 64),
}  # fmt: skip
SHAPES = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, max_position_embeddings=32)
QWEN3 = dict(SHAPES, intermediate_size=24, num_hidden_layers=3, num_key_value_heads=1, head_dim=12,
             rope_parameters=DEFAULT)  # fmt: skip
QWEN3_CHANGES = {
    **COMMON, "rope_parameters": (YARN, *OTHER_ROPES), "hidden_size": (24,), "intermediate_size": (20,),
    "num_hidden_layers": (2,), "num_attention_heads": (4,), "num_key_value_heads": (2, None),
    "attention_bias": (True,), "use_sliding_window": (True,), "sliding_window": (4, 64),
}  # fmt: skip
SLIDING = ["full_attention", "sliding_attention", "full_attention"]

# Qwen3.5 / Qwen3-Next: hybrid layers (3 Gated DeltaNet, 1 full attention), RoPE on half of each head.
PARTIAL = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
QWEN3_5 = dict(SHAPES, intermediate_size=24, num_hidden_layers=4, num_key_value_heads=1, head_dim=8,
               linear_key_head_dim=4, linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=2,
               rope_parameters=PARTIAL)  # fmt: skip
QWEN3_5_MOE = dict(moe_intermediate_size=8, shared_expert_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
MROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 0], "mrope_interleaved": True}
QWEN3_5_CHANGES = {
    **COMMON, "rope_parameters": (LLAMA3, *OTHER_ROPES, MROPE), "hidden_size": (24,), "intermediate_size": (20,),
    "num_hidden_layers": (3,), "num_attention_heads": (4,), "num_key_value_heads": (2, None), "head_dim": (4, None),
    "attention_bias": (True,), "linear_conv_kernel_dim": (2,), "linear_key_head_dim": (8,),
    "linear_value_head_dim": (8,), "linear_num_key_heads": (1,), "linear_num_value_heads": (4,),
    "layer_types": (["full_attention", "linear_attention", "linear_attention", "full_attention"], ["attention"] * 4),
}  # fmt: skip
QWEN3_5_MOE_CHANGES = {
    **QWEN3_5_CHANGES, "moe_intermediate_size": (12,), "shared_expert_intermediate_size": (12,), "num_experts": (3,),
    "num_experts_per_tok": (1,), "output_router_logits": (True,), "router_aux_loss_coef": (0.5,),
}  # fmt: skip
QWEN3_5_EXTRA = {  # transformers' class sets partial_rotary_factor 0.25 where config.json says none
    "partial_rotary_factor 1 beside the mapping's": dict(partial_rotary_factor=1.0),
    "partial_rotary_factor 1, none in the mapping": dict(partial_rotary_factor=1.0, rope_parameters=DEFAULT),
    "no partial_rotary_factor (0.25)": dict(rope_parameters=DEFAULT),
    "full_attention_interval 2": dict(full_attention_interval=2),
}
QWEN3_5_ROPES = (PARTIAL, {"rope_type": "default", "rope_theta": 3e4})

FAMILIES = {
    "llama": HfFamily(
        base=dict(SHAPES, model_type="llama", intermediate_size=48, num_hidden_layers=2, num_key_value_heads=1,
                  rope_parameters=DEFAULT),
        changes={**COMMON, "rope_parameters": (YARN, *OTHER_ROPES), "hidden_size": (24,), "intermediate_size": (40,),
                 "num_hidden_layers": (3,), "num_attention_heads": (4,), "num_key_value_heads": (2, None),
                 "head_dim": (8, 4), "attention_bias": (True,), "mlp_bias": (True,), "pretraining_tp": (2, None)},
        ropes=(DEFAULT, LLAMA3),
    ),
    "qwen3": HfFamily(
        base=dict(QWEN3, model_type="qwen3"),
        changes={**QWEN3_CHANGES, "head_dim": (8,), "max_window_layers": (1,),
                 "layer_types": (SLIDING, ["attention"] * 3, ["full_attention"] * 2)},
        ropes=(DEFAULT, LLAMA3),
        extra={
            "window 4 from layer 1": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
            "window 64 from layer 1": dict(use_sliding_window=True, sliding_window=64, max_window_layers=1),
            "window 4 past the last layer": dict(use_sliding_window=True, sliding_window=4),
            "layer_types sliding, window 4": dict(use_sliding_window=True, sliding_window=4, layer_types=SLIDING),
        },
    ),
    "qwen3_moe": HfFamily(
        base=dict(QWEN3, model_type="qwen3_moe", moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2),
        changes={**QWEN3_CHANGES, "decoder_sparse_step": (2,), "moe_intermediate_size": (12,),
                 "num_experts_per_tok": (1, 4), "num_experts": (3,), "norm_topk_prob": (True,),
                 "output_router_logits": (True,), "router_aux_loss_coef": (0.5,), "mlp_only_layers": ([0, 2],)},
        extra={
            # Qwen3MoeConfig has no layer_types: the window covers every layer whatever it says.
            "window 4, layer_types full": dict(use_sliding_window=True, sliding_window=4,
                                               layer_types=["full_attention"] * 3),
            "layer_types sliding, no window": dict(sliding_window=4, layer_types=["sliding_attention"] * 3),
            "num_local_experts beside num_experts": dict(num_local_experts=3),
            "head_dim left out": dict(head_dim=ABSENT),
        },
    ),
    "deepseek_v3": HfFamily(
        base=dict(SHAPES, model_type="deepseek_v3", intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
                  num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.7,
                  kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=2,
                  topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                  rms_norm_eps=1e-5, rope_parameters=DEFAULT),
        changes={**COMMON, "rope_parameters": (LLAMA3, *OTHER_ROPES), "hidden_size": (24,), "intermediate_size": (20,),
                 "moe_intermediate_size": (12,), "num_hidden_layers": (3,), "num_attention_heads": (4,),
                 "num_key_value_heads": (1, None), "n_shared_experts": (2, 0), "n_routed_experts": (6,),
                 "routed_scaling_factor": (1.0,), "kv_lora_rank": (12,), "q_lora_rank": (None, 8),
                 "qk_rope_head_dim": (8,), "v_head_dim": (8,), "qk_nope_head_dim": (4,), "n_group": (1, 4, None),
                 "topk_group": (2, None), "num_experts_per_tok": (1, 3), "first_k_dense_replace": (0, 2, None),
                 "norm_topk_prob": (False, None), "output_router_logits": (True,), "pretraining_tp": (2, None),
                 "rope_interleave": (False, None), "attention_bias": (True,), "num_mtp_layers": (0, 2)},
        ropes=(DEFAULT, YARN),
        extra={"num_local_experts beside n_routed_experts": dict(num_local_experts=6),
               "num_nextn_predict_layers": dict(num_nextn_predict_layers=2)},
    ),
    "gpt_oss": HfFamily(
        base=dict(SHAPES, model_type="gpt_oss", intermediate_size=8, num_hidden_layers=2, num_local_experts=4,
                  num_key_value_heads=1, head_dim=8, sliding_window=4, num_experts_per_tok=2,
                  rope_parameters=GPT_OSS_YARN),
        changes={**COMMON, "rope_parameters": (LLAMA3, *OTHER_ROPES), "hidden_size": (24,), "intermediate_size": (12,),
                 "num_hidden_layers": (3,), "num_attention_heads": (4,), "num_key_value_heads": (2, None),
                 "head_dim": (4, None), "num_local_experts": (3,), "num_experts_per_tok": (1, 4),
                 "sliding_window": (2, 64, None), "swiglu_alpha": (1.0,), "swiglu_limit": (0.3, None),
                 "router_aux_loss_coef": (0.5,), "output_router_logits": (True,), "attention_bias": (False,),
                 "layer_types": (["full_attention", "sliding_attention"], ["full_attention"] * 2,
                                 ["sliding_attention"] * 2, ["attention", "sliding_attention"], ["full_attention"])},
        ropes=(GPT_OSS_YARN, DEFAULT),
        extra={"num_experts beside num_local_experts": dict(num_experts=3),
               "sliding_window null, all full": dict(sliding_window=None, layer_types=["full_attention"] * 2)},
    ),
    "qwen3_5_text": HfFamily(
        base=dict(QWEN3_5, model_type="qwen3_5_text"), changes=QWEN3_5_CHANGES, ropes=QWEN3_5_ROPES, extra=QWEN3_5_EXTRA
    ),
    # RoPE's spellings are read by the function qwen3_5_text's sweep covers (and qwen3's for qwen3_moe).
    "qwen3_5_moe_text": HfFamily(
        base=dict(QWEN3_5, model_type="qwen3_5_moe_text", **QWEN3_5_MOE), changes=QWEN3_5_MOE_CHANGES,
        extra=QWEN3_5_EXTRA,
    ),
    "qwen3_next": HfFamily(
        base=dict(QWEN3_5, model_type="qwen3_next", **QWEN3_5_MOE), extra=QWEN3_5_EXTRA,
        changes={**QWEN3_5_MOE_CHANGES, "decoder_sparse_step": (2,), "norm_topk_prob": (False,),
                 "mlp_only_layers": ([1],)},
    ),
    "llama4_text": HfFamily(
        base=dict(SHAPES, model_type="llama4_text", intermediate_size=8, intermediate_size_mlp=24, num_hidden_layers=4,
                  num_key_value_heads=1, head_dim=8, num_local_experts=3, num_experts_per_tok=1,
                  interleave_moe_layer_step=2, attention_chunk_size=8,
                  rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        changes={**COMMON, "rope_parameters": (YARN, *OTHER_ROPES), "hidden_size": (24,), "intermediate_size": (12,),
                 "intermediate_size_mlp": (20,), "num_hidden_layers": (3,), "num_attention_heads": (4,),
                 "num_key_value_heads": (2, None), "head_dim": (4, None), "num_local_experts": (2,),
                 "num_experts_per_tok": (2,), "moe_layers": ([0, 3], [], None), "interleave_moe_layer_step": (1, 3),
                 "use_qk_norm": (False,), "output_router_logits": (True,), "router_aux_loss_coef": (0.5,),
                 "router_jitter_noise": (0.1,), "no_rope_layers": ([1, 0, 1, 1], [], None),
                 "no_rope_layer_interval": (2,), "attention_chunk_size": (4, None, 64),
                 "layer_types": (["full_attention", "chunked_attention"] * 2, ["attention"] * 4),
                 "attn_temperature_tuning": (False,), "floor_scale": (4,), "attn_scale": (0.5,),
                 "attention_bias": (True,)},
        ropes=({"rope_type": "default", "rope_theta": 5e5}, LLAMA3),
    ),
}  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """The sweep builds hundreds of configs transformers warns about; the outcomes are asserted."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.utils.logging.enable_progress_bar()
    transformers.logging.set_verbosity(verbosity)


def _kinds(outcomes: dict[str, Outcome], *labels: str) -> list[tuple[str, bool]]:
    return [(outcomes[label].kind, outcomes[label].changed) for label in labels]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_config_field_reads_as_transformers_or_is_refused(name: str, tmp_path) -> None:
    family = FAMILIES[name]
    outcomes = sweep_import(family, tmp_path)
    assert not failures(outcomes), "\n".join(failures(outcomes))
    if family.ropes:
        rope = "rope 1"  # the family's second RoPE, not the base's: visible in the logits
        assert _kinds(
            outcomes,
            f"{rope}",
            f"{rope} beside a top-level rope_theta",  # rope_parameters' theta wins
            f"{rope} without theta, top-level rope_theta",  # then the top-level one
            f"{rope} as rope_scaling beside rope {family.ropes[0]['rope_type']}",  # rope_scaling wins
        ) == [("match", True), ("match", True), ("match", True), ("match", True)]
        assert outcomes[f"{rope} without theta, top-level rope_theta null"].kind == "unrunnable"
        assert outcomes["rope 0 rope_theta=None"].kind == "unrunnable"
    for key in ("hidden_size", "num_hidden_layers", "vocab_size"):  # transformers' defaults: other shapes
        assert outcomes[f"{key}=<absent>"].kind == "contradiction", outcomes[f"{key}=<absent>"]
    if name == "qwen3_moe":
        assert outcomes["window 4, layer_types full"].kind == "refused"


# titan args fields the export sweep leaves alone: how the model trains (an export does not describe
# it), and the settings config.json states directly (the import sweep exports each value it reads).
UNTOUCHED = {
    "depth_init", "attn_type", "attn_mask_type", "moe_args.use_grouped_mm", "moe_args.aux_loss_coeff",
    "moe_args.force_load_balance", "linear_attn_backend", "dim", "n_layers", "n_heads", "vocab_size", "norm_eps",
    "rope_theta", "use_rope_scaling", "max_seq_len", "tie_embeddings",
}  # fmt: skip
# Spellings of one model (n_kv_heads None, the SwiGLU width's multiple_of / multiplier) and settings
# without effect (Llama 3.1 scaling's while it is off) must export too.
LLAMA_EXPORTS = {
    "n_kv_heads": (None, 2), "multiple_of": (32,), "ffn_dim_multiplier": (1.5,), "rope_scale_factor": (4.0,),
    "rope_low_freq_factor": (2.0,), "rope_high_freq_factor": (8.0,), "rope_original_max_position_embeddings": (8,),
}  # fmt: skip
MOE_EXPORTS = {
    "moe_args.num_experts": (3,), "moe_args.num_shared_experts": (0, 1, 2), "moe_args.top_k": (1, 2),
    "moe_args.score_func": ("sigmoid", "softmax"), "moe_args.route_norm": (True, False), "moe_args.route_scale": (2.0,),
    "moe_args.gate_bias": (True,), "moe_args.score_before_experts": (True, False), "moe_args.hidden_dim": (12,),
    "moe_args.load_balance_coeff": (None,), "moe_args.experts_bias": (True, False),
    "moe_args.swiglu_limit": (None, 0.3), "moe_args.swiglu_alpha": (1.0,), "moe_args.num_expert_groups": (None, 2),
    "moe_args.num_limited_groups": (None, 1), "moe_args.shared_hidden_dim": (12,),
    "moe_args.shared_expert_gate": (True, False),
}  # fmt: skip
QWEN3_5_EXPORTS = {
    **LLAMA_EXPORTS, **MOE_EXPORTS, "head_dim": (4,), "hidden_dim": (20,), "moe_enabled": (False,),
    "decoder_sparse_step": (2,), "mlp_only_layers": ([1],), "partial_rotary_factor": (1.0,),
    "layer_types": (["full_attention"] * 4,), "full_attention_interval": (2,), "linear_num_key_heads": (1,),
    "linear_num_value_heads": (4,), "linear_key_head_dim": (8,), "linear_value_head_dim": (8,),
    "linear_conv_kernel_dim": (2,), "release": ("qwen3_next", "qwen3_5"), "mtp_depth": (1,),
}  # fmt: skip
# One export sweep per titan family (args class), from an MoE config where it has one: moe_enabled
# false and release cover its other Hugging Face types.
EXPORTS: dict[str, dict[str, tuple[Any, ...]]] = {
    "llama": LLAMA_EXPORTS,
    "qwen3_moe": {**LLAMA_EXPORTS, **MOE_EXPORTS, "head_dim": (8,), "hidden_dim": (20,), "moe_enabled": (False,),
                  "decoder_sparse_step": (2,), "mlp_only_layers": ([0],)},
    "deepseek_v3": {**LLAMA_EXPORTS, **MOE_EXPORTS, "inter_dim": (20,), "moe_inter_dim": (12,),
                    "n_dense_layers": (0, 2), "q_lora_rank": (0, 8), "kv_lora_rank": (12,),
                    "qk_nope_head_dim": (4,), "qk_rope_head_dim": (8,), "v_head_dim": (8,),
                    "latent_norm_eps": (None, 1e-5), "original_seq_len": (8, 64), "rope_factor": (2.0,),
                    "beta_fast": (8.0,), "beta_slow": (2.0,), "mscale": (0.5,), "use_yarn": (None, True),
                    "rope_attention_factor": (1.2,), "mtp_depth": (1,)},
    "gpt_oss": {**LLAMA_EXPORTS, **MOE_EXPORTS, "head_dim": (4,), "attention_bias": (False,),
                "sliding_window_size": (None, 2), "layer_types": (["full_attention"] * 2,),
                "rope_type": ("default",), "rope_factor": (2.0,), "original_seq_len": (16,), "ntk_alpha": (2.0,),
                "ntk_beta": (16.0,), "rope_truncate": (True,), "rope_attention_factor": (1.2,)},
    "qwen3_next": QWEN3_5_EXPORTS,
    "llama4_text": {**LLAMA_EXPORTS, **MOE_EXPORTS, "interleave_moe_layer_step": (1, 3),
                    "auto_scale_hidden_dim": (False,), "every_n_layers_nope": (2,), "fixed_attn_block_size": (4,),
                    "moe_layers": ([0, 3],), "nope_layers": ([1],), "chunked_layers": ([0, 1],),
                    "use_qk_norm": (False,), "attn_temperature_tuning": (False,), "floor_scale": (4,),
                    "attn_scale": (0.5,)},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPORTS))
def test_every_model_setting_exports_as_transformers_runs_it_or_is_refused(name: str, tmp_path) -> None:
    base = spec_for_hf_model_type(name).state_dict_adapter.hf_config_to_args(dict(FAMILIES[name].base))
    outcomes = sweep_export(base, EXPORTS[name], UNTOUCHED, tmp_path)
    assert not failures(outcomes), "\n".join(failures(outcomes))
    if name == "deepseek_v3":  # what transformers runs: no YaRN where none is derived, a zero routing bias
        assert [outcomes[k].kind for k in ("use_yarn=None", "moe_args.load_balance_coeff=None")] == ["match"] * 2
    if name == "gpt_oss":  # no window: every layer full
        assert outcomes["sliding_window_size=None"].kind == "match"


def test_sweeps_cover_every_family_titan_reads() -> None:
    """Every config.json model_type titan reads is swept, and every titan family's export (each
    sweep fails on a field it does not change)."""
    from titan.models import _REGISTRY

    specs = [s for s in _REGISTRY.specs().values() if s.state_dict_adapter is not None]
    read = {t for spec in specs for t in getattr(spec.state_dict_adapter, "hf_model_types", ())}
    # llama4: the multimodal wrapper of llama4_text; kimi_k2: a DeepseekV3Config under its own name
    assert read - {"llama4", "kimi_k2"} == set(FAMILIES)
    assert {spec_for_hf_model_type(t).name for t in EXPORTS} == {spec.name for spec in specs}
