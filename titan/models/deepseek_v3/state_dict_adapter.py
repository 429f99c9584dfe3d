"""titan deepseek_v3 <-> Hugging Face `DeepseekV3ForCausalLM` state dicts and configs.

Layout differences besides names:
- Routed experts: HF fuses gate and up into ``experts.gate_up_proj`` [E, 2 * hidden, dim] (gate
  rows first) beside ``experts.down_proj`` [E, dim, hidden]; titan keeps w1 / w3 [E, hidden, dim]
  and w2 [E, dim, hidden]. Row slices and a concat: a round trip is bitwise lossless; a layer's w1
  and w3 must be converted together.
- Routing bias: HF's ``gate.e_score_correction_bias`` is titan's auxiliary-loss-free ``moe.expert_bias``
  (both shift only which experts are chosen).
- RoPE: with ``rope_interleave`` (transformers' default and the released checkpoints) HF rotates
  DeepSeek's interleaved pairs as titan does, so no weight is permuted.

Every field of DeepseekV3Config is in HF_FIELDS: read into the args, or refused in one line when
its value is one titan's model cannot compute, or named as having no effect on the weights'
function. Absent fields take transformers' defaults (TRANSFORMERS_DEFAULTS).
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError
from titan.log import logger
from titan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from titan.models.llama.state_dict_adapter import (
    hf_rope,
    layers_from_hf,
    layers_to_hf,
    mlp_experts_from_hf,
    mlp_experts_to_hf,
    tied_from_shapes,
)
from titan.models.moe import MoEArgs

_LAYER_MAP = MappingProxyType(
    {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wq_a.weight": "self_attn.q_a_proj.weight",
        "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attention.wq_b.weight": "self_attn.q_b_proj.weight",
        "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
        "moe.expert_bias": "mlp.gate.e_score_correction_bias",
        "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
        "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
        "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    }
)
_LAYER_INV = MappingProxyType({v: k for k, v in _LAYER_MAP.items()})

# transformers' DeepseekV3Config defaults: what an absent field means.
TRANSFORMERS_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType(
    {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "output_router_logits": False, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "hidden_act": "silu", "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
        "use_cache": True, "pad_token_id": None, "bos_token_id": 0, "eos_token_id": 1, "pretraining_tp": 1,
        "tie_word_embeddings": False, "rope_parameters": None, "rope_interleave": True, "attention_bias": False,
        "attention_dropout": 0.0, "num_mtp_layers": 1,
    }
)  # fmt: skip

# How each DeepseekV3Config field reaches titan: "args" (read into DeepSeekV3ModelArgs, written
# back on export), "refused" (only transformers' default value is accepted), "inert" (no effect on
# the model's weights or logits: caching, outputs, token ids, init of a fresh model).
HF_FIELDS: MappingProxyType[str, str] = MappingProxyType(
    {
        **{k: "args" for k in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
            "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
            "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
        )},
        **{k: "refused" for k in (
            "num_key_value_heads", "hidden_act", "rope_interleave", "attention_bias", "attention_dropout",
            "pretraining_tp",
        )},
        **{k: "inert" for k in (
            "output_router_logits", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
            "eos_token_id", "num_mtp_layers",
        )},
    }
)  # fmt: skip

_HF_LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm keep their default eps
_YARN_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
     "mscale", "mscale_all_dim", "attention_factor", "truncate", "partial_rotary_factor"}
)  # fmt: skip


def to_hf(
    state_dict: dict[str, torch.Tensor], model_args: DeepSeekV3ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """titan state dict (full tensors; a layer's experts.w1 and w3 together) -> HF keys."""

    def experts(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if rest == "moe.expert_bias":  # transformers keeps it fp32 whatever the weights' dtype
            return {f"model.layers.{layer}.{_LAYER_MAP[rest]}": value.float()}
        return mlp_experts_to_hf(state_dict, layer, rest, value, dtype)

    return layers_to_hf(state_dict, model_args, dtype, "DeepSeek-V3", _LAYER_MAP, experts)


def skipped_hf_layer(layer: int, model_args: DeepSeekV3ModelArgs) -> str | None:
    """Why Hugging Face layer ``layer`` is not imported (None: it is). The layers from
    num_hidden_layers on hold the multi-token-prediction (MTP) modules of DeepSeek-V3 and Kimi K2
    (their layer 61: embed/enorm/hnorm/eh_proj/shared_head and a decoder block); titan's
    deepseek_v3 has no MTP module, so they are skipped (transformers skips them too). The one
    place that decides: a model with MTP modules maps those layers here instead."""
    if layer >= model_args.n_layers:
        return "multi-token prediction, which titan's deepseek_v3 does not build"
    return None


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_args: DeepSeekV3ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF DeepseekV3ForCausalLM state dict (transformers' in-memory layout) -> titan keys."""

    def special(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if skipped_hf_layer(int(layer), model_args) is not None:
            return {}
        if rest == "mlp.gate.e_score_correction_bias":
            if model_args.moe_args.load_balance_coeff is None:
                if not value.is_meta and bool(value.abs().max() > 0):
                    raise TitanError(
                        f"model.layers.{layer}.{rest} is not zero but moe_args.load_balance_coeff is None (the"
                        " model would have no routing bias)"
                    )
                return {}
            return {f"layers.{layer}.moe.expert_bias": value.float()}
        return mlp_experts_from_hf(layer, rest, value, dtype)

    return layers_from_hf(hf_state_dict, model_args, dtype, "DeepSeek-V3", _LAYER_INV, special)


def _refuse_unsupported(config: dict[str, Any]) -> None:
    get = lambda k: config.get(k, TRANSFORMERS_DEFAULTS[k])  # noqa: E731
    heads = get("num_key_value_heads")
    if heads != get("num_attention_heads"):  # transformers' model breaks on any other count too
        raise TitanError(
            f"config.json num_key_value_heads {heads} != num_attention_heads: DeepSeek-V3's latent attention"
            " expands keys and values to every head"
        )
    for key, ok, why in (
        ("hidden_act", "silu", "titan's experts are SwiGLU"),
        ("rope_interleave", True, "titan reads interleaved rotary pairs, as released checkpoints store them"),
        ("attention_bias", False, "titan's latent attention projections have no bias"),
        ("attention_dropout", 0.0, "titan trains without attention dropout"),
        ("pretraining_tp", 1, "it only splits matmuls of other transformers models"),
    ):
        if get(key) != ok:
            raise TitanError(f"config.json {key} is {get(key)!r}; titan's deepseek_v3 supports only {ok!r} ({why})")


def _rope_args(rope: dict[str, Any], max_pos: int) -> dict[str, Any]:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", 10000.0))
    if rope_type == "default":
        return dict(rope_theta=theta, use_yarn=False)
    if rope_type != "yarn":
        raise TitanError(f"config.json rope_parameters rope_type {rope_type!r} is not supported; valid: default, yarn")
    unknown = sorted(set(rope) - _YARN_KEYS)
    if unknown:
        raise TitanError(f"config.json rope_parameters has {unknown}, which titan's YaRN does not read")
    if not rope.get("truncate", True) or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise TitanError("config.json rope_parameters truncate false / partial_rotary_factor != 1 are not supported")
    original = int(rope.get("original_max_position_embeddings", max_pos))
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_pos / original
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    attention = rope.get("attention_factor")
    if attention is None:  # transformers' derivation (titan.models.rope.YarnScaling.cos_sin_scale)

        def m(s: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * s * math.log(factor) + 1.0

        attention = m(mscale) / m(all_dim) if mscale and all_dim else m(1.0)
    return dict(
        rope_theta=theta, use_yarn=True, rope_factor=factor, original_seq_len=original,
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(all_dim or 0.0), rope_attention_factor=float(attention),
    )  # fmt: skip


def hf_config_to_args(config: dict[str, Any]) -> DeepSeekV3ModelArgs:
    """HF DeepseekV3Config (config.json as a dict) -> DeepSeekV3ModelArgs; absent fields are
    transformers' defaults."""
    _refuse_unsupported(config)
    get = lambda k: config.get(k, TRANSFORMERS_DEFAULTS[k])  # noqa: E731
    experts, groups, limited = get("n_routed_experts"), get("n_group"), get("topk_group")
    if groups is None or limited is None or experts % groups:
        raise TitanError(f"config.json n_group {groups} / topk_group {limited} must split n_routed_experts {experts}")
    rope = hf_rope(config)
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    args = DeepSeekV3ModelArgs(
        vocab_size=get("vocab_size"), dim=get("hidden_size"), inter_dim=get("intermediate_size"),
        moe_inter_dim=get("moe_intermediate_size"), n_layers=get("num_hidden_layers"),
        n_heads=get("num_attention_heads"), n_dense_layers=min(get("first_k_dense_replace"), get("num_hidden_layers")),
        norm_eps=float(get("rms_norm_eps")), latent_norm_eps=_HF_LATENT_EPS, max_seq_len=get("max_position_embeddings"),
        tie_embeddings=bool(get("tie_word_embeddings")), q_lora_rank=get("q_lora_rank") or 0,
        kv_lora_rank=get("kv_lora_rank"), qk_nope_head_dim=get("qk_nope_head_dim"),
        qk_rope_head_dim=get("qk_rope_head_dim"), v_head_dim=get("v_head_dim"),
        moe_args=MoEArgs(
            num_experts=experts, num_shared_experts=get("n_shared_experts"), top_k=get("num_experts_per_tok"),
            score_func="sigmoid", route_norm=bool(get("norm_topk_prob")),
            route_scale=float(get("routed_scaling_factor")), score_before_experts=False,
            # All groups kept is no limit at all (and transformers' groups of one expert would fail).
            num_expert_groups=None if limited >= groups else groups,
            num_limited_groups=None if limited >= groups else limited,
        ),
        **_rope_args(rope, get("max_position_embeddings")),
    )  # fmt: skip
    args.validate()
    return args


def args_to_hf_config(args: DeepSeekV3ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """DeepSeekV3ModelArgs -> a config.json dict that transformers' DeepseekV3ForCausalLM loads."""
    moe = args.moe_args
    if moe.score_func != "sigmoid" or moe.score_before_experts:
        raise TitanError(
            "Hugging Face DeepSeek-V3 routes with sigmoid scores applied to the experts' outputs; this model has"
            f" score_func {moe.score_func!r}, score_before_experts {moe.score_before_experts} (softmax flavors such"
            " as 16B are DeepSeek-V2-style)"
        )
    latent_eps = args.latent_norm_eps if args.latent_norm_eps is not None else args.norm_eps
    if latent_eps != _HF_LATENT_EPS:
        raise TitanError(
            f"Hugging Face DeepSeek-V3 fixes the q/kv latent norms' eps at {_HF_LATENT_EPS}; this model uses"
            f" {latent_eps} (set model latent_norm_eps = {_HF_LATENT_EPS} to train an exportable model)"
        )
    if moe.load_balance_coeff is None:
        logger.info("no routing bias (load_balance_coeff None): the export's e_score_correction_bias is absent")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.yarn_enabled:
        rope |= {
            "rope_type": "yarn", "factor": args.rope_factor, "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast, "beta_slow": args.beta_slow, "mscale_all_dim": args.mscale,
            "attention_factor": args.rope_attention_factor,
        }  # fmt: skip
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": args.vocab_size,
        "hidden_size": args.dim, "intermediate_size": args.inter_dim, "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "n_shared_experts": moe.num_shared_experts, "n_routed_experts": moe.num_experts,
        "routed_scaling_factor": moe.route_scale, "kv_lora_rank": args.kv_lora_rank,
        "q_lora_rank": args.q_lora_rank or None, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "qk_nope_head_dim": args.qk_nope_head_dim,
        "n_group": moe.num_expert_groups or 1, "topk_group": moe.num_limited_groups or 1,
        "num_experts_per_tok": moe.top_k, "first_k_dense_replace": args.n_dense_layers,
        "norm_topk_prob": moe.route_norm, "hidden_act": "silu", "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps, "tie_word_embeddings": args.tie_embeddings, "rope_parameters": rope,
        "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0,
        # titan trains no multi-token-prediction modules, so the export holds none.
        "num_nextn_predict_layers": 0, "torch_dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip


def args_from_shapes(shapes: dict[str, tuple[int, ...]], base: DeepSeekV3ModelArgs, where: str) -> DeepSeekV3ModelArgs:
    """``base`` (a flavor) with vocab_size, n_layers and tie_embeddings read off a checkpoint's shapes."""
    if "tok_embeddings.weight" not in shapes:
        raise TitanError(f"{where}: no tok_embeddings.weight; cannot infer the model shape")
    vocab, dim = shapes["tok_embeddings.weight"]
    if dim != base.dim:
        raise TitanError(f"{where}: embedding width {dim} is not the flavor's dim {base.dim}; pick the right flavor")
    n_layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("layers."))
    args = replace(base, vocab_size=vocab, n_layers=n_layers, tie_embeddings=tied_from_shapes(shapes, base))
    args.validate()
    return args


def state_dict_shapes(args: DeepSeekV3ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a full model state dict holds (parameters and the balancing bias), unsharded."""
    from titan.models.deepseek_v3.model import DeepSeekV3Transformer

    with torch.device("meta"):
        model = DeepSeekV3Transformer(replace(args, max_seq_len=1, use_yarn=args.yarn_enabled))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class DeepSeekV3StateDictAdapter:
    """The registry's handle on this module (ModelSpec.state_dict_adapter)."""

    hf_model_types = ("deepseek_v3", "kimi_k2")  # Kimi K2 / K2.x: DeepseekV3ForCausalLM with its own values
    hf_per_expert = True  # releases store one key per routed expert (written so on export)
    skipped_hf_layer = staticmethod(skipped_hf_layer)
    args_from_shapes = staticmethod(args_from_shapes)
    state_dict_shapes = staticmethod(state_dict_shapes)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    hf_config_to_args = staticmethod(hf_config_to_args)
    args_to_hf_config = staticmethod(args_to_hf_config)
