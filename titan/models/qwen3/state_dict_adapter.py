"""titan qwen3 <-> Hugging Face `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` state dicts and configs.

titan's qwen3 rotates with Hugging Face's half-split pairing, so q/k projections and q/k norms keep
their feature order: tensors map one to one, except the routed experts. Hugging Face checkpoints
store each expert apart (``mlp.experts.{e}.gate_proj.weight`` [hidden, dim], as save_pretrained
writes them); transformers' model in memory fuses them (``mlp.experts.gate_up_proj`` [E, 2 * hidden,
dim], gate first, and ``down_proj`` [E, dim, hidden]), and so does titan's folder reader
(titan.checkpointing.hf_folder) before this adapter sees the keys. titan stacks them: w1 / w3
[E, hidden, dim], w2 [E, dim, hidden]. Exports write the per-expert layout (``hf_per_expert``).

Configs: every field of Qwen3Config and Qwen3MoeConfig is mapped exactly or refused in one line that
names it; a field absent from config.json takes transformers' default (``QWEN3_DEFAULTS``,
``QWEN3_MOE_DEFAULTS``). docs/qwen3.md has the table.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError
from titan.models.llama.state_dict_adapter import (
    args_from_shapes,
    hf_rope_scaling,
    layers_from_hf,
    layers_to_hf,
    mlp_experts_from_hf,
    mlp_experts_to_hf,
    unmapped_routing_bias,
    with_hf_rope_scaling,
    zero_routing_bias,
)
from titan.models.moe import MoEArgs
from titan.models.qwen3.args import Qwen3ModelArgs

_LAYER_MAP = MappingProxyType(
    {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
    }
)
_LAYER_INV = MappingProxyType({v: k for k, v in _LAYER_MAP.items()})

# transformers 5.24's defaults for a field config.json leaves out (tests compare them with the classes).
QWEN3_DEFAULTS: Any = MappingProxyType(
    dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
        attention_dropout=0.0,
    )
)
QWEN3_MOE_DEFAULTS: Any = MappingProxyType(
    dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=4096,
        attention_dropout=0.0,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        num_experts=128,
        norm_topk_prob=False,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )
)
_ROPE_THETA_DEFAULT = 10000.0  # transformers' rope_parameters default for both classes


def to_hf(
    state_dict: dict[str, torch.Tensor], model_args: Qwen3ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """titan state dict (full tensors; a layer's w1 and w3 together) -> HF keys, experts fused as
    transformers holds them."""

    def experts(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if rest == "moe.expert_bias":
            return unmapped_routing_bias(layer, value, "Qwen3-MoE", "router scores")
        return mlp_experts_to_hf(state_dict, layer, rest, value, dtype)

    return layers_to_hf(state_dict, model_args, dtype, "Qwen3", _LAYER_MAP, experts)


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_args: Qwen3ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF Qwen3 / Qwen3-MoE state dict (transformers' in-memory layout) -> titan keys."""

    def experts(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        return mlp_experts_from_hf(layer, rest, value, dtype)

    out = layers_from_hf(hf_state_dict, model_args, dtype, "Qwen3", _LAYER_INV, experts)
    if model_args.moe_enabled:
        zero_routing_bias(out, model_args.moe_args)
    return out


def _refuse(field: str, value: Any, why: str) -> TitanError:
    return TitanError(f"config.json {field} = {value!r} is not supported by titan's qwen3: {why}")


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(theta, scaling entries) of config.json: rope_parameters (transformers >= 5) or the older
    rope_theta + rope_scaling; absent: transformers' default (theta 10000, no scaling)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(config.get("rope_theta", rope.get("rope_theta", _ROPE_THETA_DEFAULT)))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"], "every feature rotates")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise _refuse("rope_parameters.rope_type", rope_type, "valid: default, llama3")
    return theta, rope


def hf_config_to_args(config: dict[str, Any]) -> Qwen3ModelArgs:
    """HF Qwen3Config / Qwen3MoeConfig (config.json as a dict) -> Qwen3ModelArgs, exactly or refused."""
    model_type = config.get("model_type", "qwen3")
    if model_type not in Qwen3StateDictAdapter.hf_model_types:
        raise TitanError(f"config.json model_type is {model_type!r}; titan's qwen3 reads 'qwen3' and 'qwen3_moe'")
    moe = model_type == "qwen3_moe"
    if moe and "num_local_experts" in config and "num_experts" not in config:
        config = {**config, "num_experts": config["num_local_experts"]}  # transformers' attribute_map
    c = {**(QWEN3_MOE_DEFAULTS if moe else QWEN3_DEFAULTS), **{k: v for k, v in config.items()}}
    dim, n_heads = c["hidden_size"], c["num_attention_heads"]
    if "head_dim" not in c or c["head_dim"] is None:
        c["head_dim"] = dim // n_heads  # Qwen3-MoE's attention falls back to this
    if c["hidden_act"] != "silu":
        raise _refuse("hidden_act", c["hidden_act"], "the feed-forward is SwiGLU (silu)")
    if c["attention_bias"]:
        raise _refuse("attention_bias", True, "the q/k/v/o projections have no bias")
    if c["attention_dropout"]:
        raise _refuse("attention_dropout", c["attention_dropout"], "titan's attention has no dropout")
    n_layers, max_pos = c["num_hidden_layers"], c["max_position_embeddings"]
    window = c["sliding_window"] if c["use_sliding_window"] else None
    layer_types = c.get("layer_types") or [
        "sliding_attention" if window is not None and (moe or i >= c.get("max_window_layers", 0)) else "full_attention"
        for i in range(n_layers)
    ]
    bad_types = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if bad_types:
        raise _refuse("layer_types", bad_types, "valid: full_attention (sliding_attention only without a window)")
    if "sliding_attention" in layer_types and window is None:
        raise _refuse("layer_types", layer_types, "sliding_attention layers without use_sliding_window's window")
    if "sliding_attention" in layer_types and window is not None and window < max_pos:
        raise _refuse("use_sliding_window", True, f"no sliding-window attention (sliding_window {window} < {max_pos})")
    if moe and c.get("output_router_logits"):
        raise _refuse(
            "output_router_logits", True, "HF's Switch-style balance loss is not titan's (moe_args.aux_loss_coeff)"
        )
    theta, rope = _rope(c)
    kv = c["num_key_value_heads"] or n_heads
    args = Qwen3ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=kv,
        vocab_size=c["vocab_size"],
        head_dim=c["head_dim"],
        hidden_dim=c["intermediate_size"],
        norm_eps=float(c["rms_norm_eps"]),
        rope_theta=theta,
        max_seq_len=max_pos,
        tie_embeddings=bool(c["tie_word_embeddings"]),
    )
    if moe and c["num_experts"] > 0:
        args.moe_enabled = True
        args.decoder_sparse_step = c["decoder_sparse_step"]
        args.mlp_only_layers = list(c.get("mlp_only_layers") or [])
        args.moe_args = MoEArgs(
            num_experts=c["num_experts"],
            num_shared_experts=0,
            top_k=c["num_experts_per_tok"],
            score_func="softmax",
            route_norm=bool(c["norm_topk_prob"]),
            score_before_experts=False,
            hidden_dim=c["moe_intermediate_size"],
        )
    args = with_hf_rope_scaling(args, rope)
    args.validate()
    return args


def args_to_hf_config(args: Qwen3ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Qwen3ModelArgs -> a config.json dict transformers' Qwen3(Moe)ForCausalLM loads as the same model."""
    rope: dict[str, Any] = {"rope_type": "default", **(hf_rope_scaling(args) or {}), "rope_theta": args.rope_theta}
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if args.moe_enabled else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.moe_enabled else "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if not args.moe_enabled:
        return out
    moe = args.moe_args
    if moe.num_shared_experts or moe.score_func != "softmax" or moe.route_scale != 1.0 or moe.gate_bias:
        raise TitanError(
            "Hugging Face Qwen3-MoE routes with softmax scores, no shared expert, route_scale 1 and no gate bias;"
            f" this model has score_func {moe.score_func!r}, num_shared_experts {moe.num_shared_experts},"
            f" route_scale {moe.route_scale}, gate_bias {moe.gate_bias}"
        )
    if moe.score_before_experts:
        raise TitanError(
            "Hugging Face Qwen3-MoE scales the experts' outputs by the router score: set score_before_experts false"
        )
    return out | {
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "moe_intermediate_size": moe.hidden_dim,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.route_norm,
        "output_router_logits": False,
    }


def state_dict_shapes(args: Qwen3ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a full model state dict holds (parameters and the balancing bias), unsharded."""
    from titan.models.qwen3.model import Qwen3Transformer

    with torch.device("meta"):
        model = Qwen3Transformer(replace(args, max_seq_len=1))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class Qwen3StateDictAdapter:
    """The registry's handle on this module (ModelSpec.state_dict_adapter)."""

    drops_routing_bias = True  # its HF format has none: an export drops titan's only when told to
    hf_model_types = ("qwen3", "qwen3_moe")
    hf_per_expert = True  # releases store one key per routed expert (written so on export)
    args_from_shapes = staticmethod(args_from_shapes)
    state_dict_shapes = staticmethod(state_dict_shapes)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    hf_config_to_args = staticmethod(hf_config_to_args)
    args_to_hf_config = staticmethod(args_to_hf_config)
