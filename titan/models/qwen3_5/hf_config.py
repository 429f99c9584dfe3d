"""qwen3_5 args <-> the config.json of transformers' Qwen3_5TextConfig ("qwen3_5_text"),
Qwen3_5MoeTextConfig ("qwen3_5_moe_text") and Qwen3NextConfig ("qwen3_next").

Every field maps exactly or is refused in one line naming it; an absent field means what
transformers reads (the ``*_DEFAULTS`` tables, compared with the classes by the tests). Fields that
do not change the model (initializer_range, use_cache, token ids, router_aux_loss_coef without
router logits) are read and ignored. RoPE: rope_parameters (or the older rope_theta /
rope_scaling / partial_rotary_factor); its mrope_section and mrope_interleaved change nothing for
text, where the three position streams are equal.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError
from titan.models.moe import MoEArgs
from titan.models.qwen3.state_dict_adapter import QWEN3_MOE_DEFAULTS
from titan.models.qwen3_5.args import LAYER_TYPES, Qwen35ModelArgs

HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
_ARCH = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}
# The fields Qwen3's config classes share, with their defaults (the tests check each class's own).
_SHARED = ("hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias")
_COMMON = dict(
    **{k: QWEN3_MOE_DEFAULTS[k] for k in (*_SHARED, "attention_dropout")},
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    layer_types=None,
)
_MOE = dict(
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts_per_tok=8,
    num_experts=256,
    output_router_logits=False,
)
# transformers 5.24's defaults for a field config.json leaves out.
DEFAULTS: Any = MappingProxyType(
    {
        "qwen3_5_text": MappingProxyType(
            {**_COMMON, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
             "num_key_value_heads": 4}
        ),
        "qwen3_5_moe_text": MappingProxyType({**_COMMON, **_MOE, "vocab_size": 248320}),
        "qwen3_next": MappingProxyType(
            {**_COMMON, **_MOE, "vocab_size": 151936, "intermediate_size": 5632, "num_hidden_layers": 48,
             "num_experts_per_tok": 10, "num_experts": 512, "decoder_sparse_step": 1, "norm_topk_prob": True,
             "mlp_only_layers": None}
        ),
    }
)  # fmt: skip
_ROPE_THETA = 10000.0
_PARTIAL_ROTARY = 0.25  # transformers sets it for these classes when config.json has none


def _refuse(field: str, value: Any, why: str) -> TitanError:
    return TitanError(f"config.json {field} = {value!r} is not supported by titan's qwen3_5: {why}")


def _rope(c: dict[str, Any]) -> tuple[float, float]:
    """(theta, partial rotary factor) of config.json."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = float(c.get("rope_theta") or rope.get("rope_theta", _ROPE_THETA))
    partial = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", _PARTIAL_ROTARY)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _refuse("rope_parameters.rope_type", rope_type, "valid: default")
    return theta, partial


def hf_config_to_args(config: dict[str, Any]) -> Qwen35ModelArgs:
    """config.json (as a dict) of one of HF_MODEL_TYPES -> Qwen35ModelArgs, exactly or refused."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise TitanError(f"config.json model_type is {model_type!r}; titan's qwen3_5 reads {', '.join(HF_MODEL_TYPES)}")
    c = {**DEFAULTS[model_type], **config}
    for field, ok in (("hidden_act", "silu"), ("attention_bias", False)):
        if c[field] != ok:
            raise _refuse(field, c[field], f"valid: {ok!r}")
    if c["attention_dropout"]:
        raise _refuse("attention_dropout", c["attention_dropout"], "titan's attention has no dropout")
    if c.get("output_router_logits"):
        raise _refuse(
            "output_router_logits", True, "HF's Switch-style balance loss is not titan's (moe_args.aux_loss_coeff)"
        )
    n_layers = c["num_hidden_layers"]
    interval = c.get("full_attention_interval", 4)
    types = c["layer_types"] or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)
    ]
    if len(types) != n_layers or set(types) - set(LAYER_TYPES):
        raise _refuse("layer_types", types, f"{n_layers} entries of {', '.join(LAYER_TYPES)}")
    default = [("linear_attention" if (i + 1) % 4 else "full_attention") for i in range(n_layers)]
    theta, partial = _rope(c)
    n_heads = c["num_attention_heads"]
    args = Qwen35ModelArgs(
        dim=c["hidden_size"],
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=c["num_key_value_heads"] or n_heads,
        vocab_size=c["vocab_size"],
        head_dim=c["head_dim"] or c["hidden_size"] // n_heads,
        # Qwen3.5-MoE has no dense feed-forward (every layer routes): its width is the experts'.
        hidden_dim=c["moe_intermediate_size"] if model_type == "qwen3_5_moe_text" else c["intermediate_size"],
        norm_eps=float(c["rms_norm_eps"]),
        rope_theta=theta,
        partial_rotary_factor=partial,
        max_seq_len=c["max_position_embeddings"],
        tie_embeddings=bool(c["tie_word_embeddings"]),
        layer_types=None if list(types) == default else list(types),  # None: the flavors' every 4th layer
        linear_num_key_heads=c["linear_num_key_heads"],
        linear_num_value_heads=c["linear_num_value_heads"],
        linear_key_head_dim=c["linear_key_head_dim"],
        linear_value_head_dim=c["linear_value_head_dim"],
        linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
        release="qwen3_next" if model_type == "qwen3_next" else "qwen3_5",
    )
    if model_type != "qwen3_5_text" and c["num_experts"] > 0:
        args.moe_enabled = True
        args.decoder_sparse_step = c.get("decoder_sparse_step", 1)
        args.mlp_only_layers = list(c.get("mlp_only_layers") or [])
        args.moe_args = MoEArgs(
            num_experts=c["num_experts"],
            num_shared_experts=1,
            shared_hidden_dim=c["shared_expert_intermediate_size"],
            shared_expert_gate=True,
            top_k=c["num_experts_per_tok"],
            score_func="softmax",
            route_norm=bool(c.get("norm_topk_prob", True)),
            score_before_experts=False,
            hidden_dim=c["moe_intermediate_size"],
        )
    elif model_type == "qwen3_5_moe_text":
        raise _refuse("num_experts", c["num_experts"], "Qwen3.5-MoE layers all route: at least 1")
    args.validate()
    return args


def _check_moe(args: Qwen35ModelArgs) -> None:
    moe = args.moe_args
    ok = (
        moe.score_func == "softmax"
        and moe.num_shared_experts == 1
        and moe.shared_expert_gate
        and moe.route_scale == 1.0
        and not moe.gate_bias
        and not moe.score_before_experts
        and moe.num_expert_groups is None
        and not moe.experts_bias
        and moe.swiglu_limit is None
    )
    if not ok:
        raise TitanError(
            "Hugging Face Qwen3.5-MoE / Qwen3-Next route with softmax scores applied to the experts' outputs, one"
            " sigmoid-gated shared expert, route_scale 1, no gate or expert biases and no expert groups; this model's"
            f" moe_args differ ({moe})"
        )
    if args.release == "qwen3_5" and (not moe.route_norm or args.mlp_only_layers or args.decoder_sparse_step != 1):
        raise TitanError(
            "Hugging Face Qwen3.5-MoE renormalises the top-k scores in every layer's MoE: set moe_args.route_norm true,"
            ' mlp_only_layers [] and decoder_sparse_step 1, or release = "qwen3_next"'
        )


def args_to_hf_config(args: Qwen35ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Qwen35ModelArgs -> a config.json dict transformers loads as the same model."""
    if args.release == "qwen3_next":
        model_type = "qwen3_next"
    else:
        model_type = "qwen3_5_moe_text" if args.moe_enabled else "qwen3_5_text"
    out: dict[str, Any] = {
        "architectures": [_ARCH[model_type]],
        "model_type": model_type,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model_type != "qwen3_5_moe_text":
        out["intermediate_size"] = args.hidden_dim
    if not args.moe_enabled:
        if model_type == "qwen3_next":
            out["num_experts"] = 0
        return out
    _check_moe(args)
    moe = args.moe_args
    out |= {
        "moe_intermediate_size": moe.hidden_dim,
        "shared_expert_intermediate_size": moe.shared_hidden_dim or moe.hidden_dim,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "output_router_logits": False,
    }
    if model_type == "qwen3_next":
        out |= {
            "decoder_sparse_step": args.decoder_sparse_step,
            "mlp_only_layers": list(args.mlp_only_layers),
            "norm_topk_prob": moe.route_norm,
        }
    return out
