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
from titan.models.hf_config import HfConfig, hf_layer_types, moe_view, reset
from titan.models.llama.hf_config import hf_shape_fields, with_hf_rope_scaling
from titan.models.llama.hf_config import hf_view as llama_hf_view
from titan.models.llama.state_dict_adapter import (
    args_from_shapes,
    layers_from_hf,
    layers_to_hf,
    mlp_experts_from_hf,
    mlp_experts_to_hf,
    unmapped_routing_bias,
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


def _sliding(c: HfConfig, moe: bool, n_layers: int) -> None:
    """Refuse a sliding window that binds: titan's qwen3 attends over the whole causal context. As
    transformers: a window only with use_sliding_window; Qwen3-MoE slides every layer with it (and
    has no layer_types), Qwen3 the layers layer_types names (absent: from max_window_layers on)."""
    window = c.get("sliding_window") if c.flag("use_sliding_window") else None
    types = hf_layer_types(c, n_layers)
    if moe or types is None:
        start = 0 if moe else c.int("max_window_layers", minimum=0)
        slides = [window is not None and i >= start for i in range(n_layers)]
        types = ["sliding_attention" if s else "full_attention" for s in slides]
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise c.refuse("layer_types", bad, "valid: full_attention, sliding_attention")
    if "sliding_attention" not in types:
        return
    if window is None:
        raise c.refuse("layer_types", types, "sliding_attention layers need use_sliding_window and a sliding_window")
    max_pos = c.int("max_position_embeddings")
    if not isinstance(window, int) or window < max_pos:
        raise c.refuse("sliding_window", window, f"no sliding-window attention (a window >= {max_pos}, or none)")


def hf_config_to_args(config: dict[str, Any]) -> Qwen3ModelArgs:
    """HF Qwen3Config / Qwen3MoeConfig (config.json as a dict) -> Qwen3ModelArgs, exactly or refused."""
    model_type = config.get("model_type", "qwen3")
    if model_type not in Qwen3StateDictAdapter.hf_model_types:
        raise TitanError(f"config.json model_type is {model_type!r}; titan's qwen3 reads 'qwen3' and 'qwen3_moe'")
    moe = model_type == "qwen3_moe"
    aliases = {"num_local_experts": "num_experts"} if moe else {}  # Qwen3MoeConfig's attribute_map
    c = HfConfig(config, QWEN3_MOE_DEFAULTS if moe else QWEN3_DEFAULTS, "qwen3", aliases)
    dim, n_heads, n_layers = c.int("hidden_size"), c.int("num_attention_heads"), c.int("num_hidden_layers")
    c.only("hidden_act", "silu", "the feed-forward is SwiGLU")
    c.only("attention_bias", False, "the q/k/v/o projections have no bias")
    if c.get("attention_dropout") not in (0, 0.0):
        raise c.refuse("attention_dropout", c.get("attention_dropout"), "titan's attention has no dropout")
    _sliding(c, moe, n_layers)
    if moe:
        c.only("output_router_logits", False, "HF's Switch-style balance loss is not titan's aux_loss_coeff")
    # Qwen3-MoE's attention falls back to hidden_size / heads when config.json has no head_dim.
    head_dim = c.int("head_dim") if "head_dim" in c or not moe else dim // n_heads
    kv = c.get("num_key_value_heads")
    args = Qwen3ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_heads if kv is None and not moe else c.int("num_key_value_heads"),
        vocab_size=c.int("vocab_size"),
        head_dim=head_dim,
        hidden_dim=c.int("intermediate_size"),
        norm_eps=c.number("rms_norm_eps"),
        max_seq_len=c.int("max_position_embeddings"),
        tie_embeddings=c.flag("tie_word_embeddings"),
    )
    if moe and c.int("num_experts", minimum=0) > 0:
        args.moe_enabled = True
        args.decoder_sparse_step = c.int("decoder_sparse_step")
        only = c.get("mlp_only_layers")
        if only is not None and (not isinstance(only, list) or not all(isinstance(i, int) for i in only)):
            raise c.refuse("mlp_only_layers", only, "a list of layer indices is needed")
        args.mlp_only_layers = list(only or [])
        args.moe_args = MoEArgs(
            num_experts=c.int("num_experts"),
            num_shared_experts=0,
            top_k=c.int("num_experts_per_tok"),
            score_func="softmax",
            route_norm=c.flag("norm_topk_prob"),
            score_before_experts=False,
            hidden_dim=c.int("moe_intermediate_size"),
        )
    args = with_hf_rope_scaling(args, c, default_theta=_ROPE_THETA_DEFAULT)
    args.validate()
    return args


def args_to_hf_config(args: Qwen3ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Qwen3ModelArgs -> a config.json dict transformers' Qwen3(Moe)ForCausalLM loads as the same model."""
    out: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if args.moe_enabled else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.moe_enabled else "qwen3",
        **hf_shape_fields(args),
        "intermediate_size": args.hidden_dim,
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


def hf_view(args: Qwen3ModelArgs) -> Qwen3ModelArgs:
    """``args`` as config.json states them: the MoE settings only for an MoE model."""
    args = llama_hf_view(args)
    if not args.moe_enabled:
        return reset(args, ("moe_args", "decoder_sparse_step", "mlp_only_layers"))
    return replace(args, moe_args=moe_view(args.moe_args))


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
    hf_view = staticmethod(hf_view)
