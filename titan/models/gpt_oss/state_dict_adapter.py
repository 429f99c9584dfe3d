"""titan gpt_oss <-> Hugging Face `GptOssForCausalLM` state dicts and configs.

Layout differences besides names:
- Routed experts: HF fuses gate and up into ``experts.gate_up_proj`` [E, dim, 2 * hidden] with the
  gate in the EVEN columns and up in the odd ones (and ``gate_up_proj_bias`` [E, 2 * hidden] alike),
  and stores ``down_proj`` [E, hidden, dim]; titan keeps w1 / w3 [E, hidden, dim], w2 [E, dim,
  hidden] and the biases b1 / b3 / b2 apart. Strided slices, transposes and an interleave: a round
  trip is bitwise lossless. A layer's w1, w3, b1 and b3 must be converted together.
- RoPE: titan's gpt_oss rotates the two halves of each head, as transformers does: no permutation.
- Routing bias: HF has none; the auxiliary-loss-free balancing bias (``moe.expert_bias``) is dropped
  on export (with a warning when it is not zero) and starts at zero on import.

Every GptOssConfig field is either represented in GptOssModelArgs or refused in one line unless
it has the value titan computes with (see hf_config_to_args); absent fields are transformers'
defaults.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError
from titan.models.gpt_oss.args import LAYER_TYPES, GptOssModelArgs, gpt_oss_moe
from titan.models.hf_config import HfConfig, hf_layer_types, hf_rope, moe_view, reset, yarn_scaling
from titan.models.llama.hf_config import hf_shape_fields
from titan.models.llama.hf_config import hf_view as llama_hf_view
from titan.models.llama.state_dict_adapter import (
    _cast,
    layers_from_hf,
    layers_to_hf,
    tied_from_shapes,
    unmapped_routing_bias,
    zero_routing_bias,
)

_LAYER_MAP = MappingProxyType(
    {
        **{f"attention.w{a}.{p}": f"self_attn.{a}_proj.{p}" for a in "qkvo" for p in ("weight", "bias")},
        "attention.sinks": "self_attn.sinks",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "moe.router.gate.weight": "mlp.router.weight",
        "moe.router.gate.bias": "mlp.router.bias",
        "moe.experts.b2": "mlp.experts.down_proj_bias",
    }
)
_LAYER_INV = MappingProxyType({v: k for k, v in _LAYER_MAP.items()})
_FUSED = ("moe.experts.w1", "moe.experts.w3", "moe.experts.b1", "moe.experts.b3")


def _need(state_dict: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state_dict:
        raise TitanError(f"{key} is missing: HF fuses a layer's experts w1, w3, b1 and b3, convert them together")
    return state_dict[key]


def to_hf(
    state_dict: dict[str, torch.Tensor], model_args: GptOssModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """titan state dict (full tensors) -> HF GptOssForCausalLM keys."""

    def experts(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        prefix = f"model.layers.{layer}.mlp.experts"
        if rest == "moe.expert_bias":
            return unmapped_routing_bias(layer, value, "gpt-oss", "router logits")
        if rest == "moe.experts.w2":
            return {f"{prefix}.down_proj": _cast(value.transpose(-2, -1).contiguous(), dtype)}
        if rest == "moe.experts.w1":
            w3 = _need(state_dict, f"layers.{layer}.moe.experts.w3")
            # [E, dim, hidden, 2] -> [E, dim, 2 * hidden]: gate in column 2j, up in 2j + 1.
            fused = torch.stack([value.transpose(-2, -1), w3.transpose(-2, -1)], dim=-1).flatten(-2)
            return {f"{prefix}.gate_up_proj": _cast(fused, dtype)}
        if rest == "moe.experts.b1":
            b3 = _need(state_dict, f"layers.{layer}.moe.experts.b3")
            return {f"{prefix}.gate_up_proj_bias": _cast(torch.stack([value, b3], dim=-1).flatten(-2), dtype)}
        return {} if rest in _FUSED else None

    return layers_to_hf(state_dict, model_args, dtype, "gpt-oss", _LAYER_MAP, experts)


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_args: GptOssModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF GptOssForCausalLM state dict -> titan keys."""

    def experts(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        prefix = f"layers.{layer}.moe.experts"
        if rest == "mlp.experts.gate_up_proj":  # gate in column 2j, up in 2j + 1
            return {
                f"{prefix}.w1": _cast(value[..., 0::2].transpose(-2, -1).contiguous(), dtype),
                f"{prefix}.w3": _cast(value[..., 1::2].transpose(-2, -1).contiguous(), dtype),
            }
        if rest == "mlp.experts.gate_up_proj_bias":
            return {
                f"{prefix}.b1": _cast(value[..., 0::2].contiguous(), dtype),
                f"{prefix}.b3": _cast(value[..., 1::2].contiguous(), dtype),
            }
        if rest == "mlp.experts.down_proj":
            return {f"{prefix}.w2": _cast(value.transpose(-2, -1).contiguous(), dtype)}
        return None

    out = layers_from_hf(hf_state_dict, model_args, dtype, "gpt-oss", _LAYER_INV, experts)
    zero_routing_bias(out, model_args.moe_args)
    return out


# GptOssConfig fields that do not change the forward pass titan trains (bookkeeping, generation
# and initialisation settings): read and ignored.
HF_IGNORED = frozenset(
    {"initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "router_aux_loss_coef"}
)
# Fields titan computes with one value only: refused in one line when the config has another.
HF_FIXED: MappingProxyType[str, Any] = MappingProxyType(
    {"hidden_act": "silu", "attention_dropout": 0.0, "output_router_logits": False}
)
# transformers' GptOssConfig defaults (an absent field means these).
HF_DEFAULTS: MappingProxyType[str, Any] = MappingProxyType(
    {
        "num_hidden_layers": 36,
        "num_local_experts": 128,
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "rope_theta": 150000.0,
    }
)
_YARN_DEFAULT = MappingProxyType(
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096}
)  # fmt: skip
HF_MAPPED = frozenset(HF_DEFAULTS) | {"rope_parameters", "layer_types"}
"""The GptOssConfig fields GptOssModelArgs represents (tests check these three sets cover them all)."""
_ALIASES = MappingProxyType({"num_experts": "num_local_experts"})  # GptOssConfig's attribute_map


def _rope_args(c: HfConfig) -> dict[str, Any]:
    rope = hf_rope(c, types=("yarn", "default"), default_theta=HF_DEFAULTS["rope_theta"], class_default=_YARN_DEFAULT)
    theta = float(rope["rope_theta"])
    if rope["rope_type"] == "default":
        return {"rope_type": "default", "rope_theta": theta}
    yarn = yarn_scaling(rope, c.int("max_position_embeddings"))
    # The cos/sin scale: as stated, from DeepSeek's two mscales where both are set, else derived.
    scale = (
        None if yarn.attention_factor is None and not (yarn.mscale and yarn.mscale_all_dim) else yarn.cos_sin_scale()
    )
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "rope_factor": yarn.factor,
        "original_seq_len": yarn.original_max_position_embeddings,
        "ntk_beta": yarn.beta_fast,
        "ntk_alpha": yarn.beta_slow,
        "rope_truncate": yarn.truncate,
        "rope_attention_factor": scale,
    }


def hf_config_to_args(config: dict[str, Any]) -> GptOssModelArgs:
    """HF GptOssConfig (config.json as a dict) -> GptOssModelArgs, exactly or refused in one line."""
    c = HfConfig(config, {**HF_DEFAULTS, **HF_FIXED}, "gpt_oss", aliases=_ALIASES)
    c.only("hidden_act", "silu", "the experts' clamped SwiGLU")
    c.only("output_router_logits", False, "HF's Switch-style balance loss is not titan's aux_loss_coeff")
    if c.get("attention_dropout") not in (0, 0.0):
        raise c.refuse("attention_dropout", c.get("attention_dropout"), "titan's attention has no dropout")
    n_layers, n_heads, dim = c.int("num_hidden_layers"), c.int("num_attention_heads"), c.int("hidden_size")
    # transformers builds the sliding-window mask whatever the layer types: it needs a window.
    window = c.int("sliding_window")
    layer_types = hf_layer_types(c, n_layers)
    if layer_types is not None and not set(layer_types) <= set(LAYER_TYPES):
        raise c.refuse("layer_types", layer_types, f"valid: {', '.join(LAYER_TYPES)}")
    default_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    moe = gpt_oss_moe(c.int("num_local_experts"))
    moe.top_k, moe.hidden_dim = c.int("num_experts_per_tok"), c.int("intermediate_size")
    moe.swiglu_limit, moe.swiglu_alpha = c.number("swiglu_limit"), c.number("swiglu_alpha")
    kv = c.get("num_key_value_heads")
    args = GptOssModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads if kv is None else c.int("num_key_value_heads"),
        head_dim=c.int("head_dim"),
        vocab_size=c.int("vocab_size"),
        norm_eps=c.number("rms_norm_eps"),
        max_seq_len=c.int("max_position_embeddings"),
        tie_embeddings=c.flag("tie_word_embeddings"),
        attention_bias=c.flag("attention_bias"),
        sliding_window_size=window,
        layer_types=None if layer_types in (None, default_types) else layer_types,
        moe_args=moe,
        **_rope_args(c),
    )
    args.validate()
    return args


def args_to_hf_config(args: GptOssModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """GptOssModelArgs -> a config.json dict that transformers' GptOssForCausalLM loads."""
    moe = args.moe_args
    if not (moe.score_func == "softmax" and moe.route_norm and moe.route_scale == 1.0 and moe.gate_bias):
        raise TitanError(
            "Hugging Face gpt-oss routes by a softmax over the top-k biased logits (score_func softmax, route_norm,"
            f" route_scale 1, gate_bias); this model has {moe.score_func!r}, {moe.route_norm}, {moe.route_scale},"
            f" {moe.gate_bias}"
        )
    if moe.score_before_experts or not moe.experts_bias or moe.swiglu_limit is None or moe.num_shared_experts:
        raise TitanError(
            "Hugging Face gpt-oss scales the experts' outputs, has expert biases, the clamped SwiGLU and no shared"
            " expert (score_before_experts false, experts_bias true, swiglu_limit set, num_shared_experts 0)"
        )
    yarn = args.yarn()
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if yarn is not None:
        rope = {
            "rope_type": "yarn",
            "rope_theta": args.rope_theta,
            "factor": yarn.factor,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "truncate": yarn.truncate,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
        }
        if yarn.attention_factor is not None:
            rope["attention_factor"] = yarn.attention_factor
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **hf_shape_fields(args),
        "rope_parameters": rope,
        "intermediate_size": moe.hidden_dim,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "swiglu_alpha": moe.swiglu_alpha,
        "swiglu_limit": moe.swiglu_limit,
        # transformers builds the sliding-window mask whatever the layers are: it needs a window.
        "sliding_window": args.sliding_window_size or HF_DEFAULTS["sliding_window"],
        "layer_types": _layer_types(args),
        "attention_bias": args.attention_bias,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


_YARN_SETTINGS = ("rope_factor", "original_seq_len", "ntk_alpha", "ntk_beta", "rope_truncate", "rope_attention_factor")


def _layer_types(args: GptOssModelArgs) -> list[str]:
    return ["sliding_attention" if args.is_sliding(i) else "full_attention" for i in range(args.n_layers)]


def hf_view(args: GptOssModelArgs) -> GptOssModelArgs:
    """``args`` as config.json states them: YaRN's settings only with YaRN, every layer's type
    spelled out, and no window without a sliding layer."""
    args = replace(llama_hf_view(args), moe_args=moe_view(args.moe_args))
    if args.rope_type != "yarn":
        args = reset(args, _YARN_SETTINGS)
    types = _layer_types(args)
    if "sliding_attention" not in types:
        return replace(args, sliding_window_size=None, layer_types=None)
    return replace(args, layer_types=types)


def args_from_shapes(shapes: dict[str, tuple[int, ...]], base: GptOssModelArgs, where: str) -> GptOssModelArgs:
    """``base`` (a flavor) with vocab_size, n_layers and tie_embeddings read off a checkpoint's shapes."""
    if "tok_embeddings.weight" not in shapes:
        raise TitanError(f"{where}: no tok_embeddings.weight; cannot infer the model shape")
    vocab, dim = shapes["tok_embeddings.weight"]
    if dim != base.dim:
        raise TitanError(
            f"{where}: embedding width {dim} does not match the flavor's dim {base.dim}; pick the right flavor"
        )
    n_layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("layers."))
    layer_types = None if base.layer_types is None else base.layer_types[:n_layers]
    args = replace(
        base,
        vocab_size=vocab,
        n_layers=n_layers,
        tie_embeddings=tied_from_shapes(shapes, base),
        layer_types=layer_types,
    )
    args.validate()
    return args


def state_dict_shapes(args: GptOssModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a full model state dict holds (parameters and the balancing bias), unsharded."""
    from titan.models.gpt_oss.model import GptOssTransformer

    with torch.device("meta"):
        model = GptOssTransformer(replace(args, max_seq_len=1))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class GptOssStateDictAdapter:
    """The registry's handle on this module (ModelSpec.state_dict_adapter)."""

    drops_routing_bias = True  # its HF format has none: an export drops titan's only when told to
    hf_model_types = ("gpt_oss",)
    args_from_shapes = staticmethod(args_from_shapes)
    state_dict_shapes = staticmethod(state_dict_shapes)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    hf_config_to_args = staticmethod(hf_config_to_args)
    args_to_hf_config = staticmethod(args_to_hf_config)
    hf_view = staticmethod(hf_view)
