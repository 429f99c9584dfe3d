"""qwen3_5 args <-> the config.json of transformers' Qwen3_5TextConfig ("qwen3_5_text"),
Qwen3_5MoeTextConfig ("qwen3_5_moe_text") and Qwen3NextConfig ("qwen3_next").

Every field maps exactly or is refused in one line naming it; an absent field means what
transformers reads (the ``*_DEFAULTS`` tables, compared with the classes by the tests). Fields that
do not change the model (initializer_range, use_cache, token ids, router_aux_loss_coef without
router logits) are read and ignored. RoPE is read as transformers resolves it
(titan.models.hf_config.hf_rope), its partial_rotary_factor 0.25 when config.json states none; its
mrope_section and mrope_interleaved change nothing for text, where the three position streams are
equal.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError
from titan.models.hf_config import HfConfig, hf_layer_types, hf_rope, moe_view, reset
from titan.models.llama.hf_config import hf_shape_fields
from titan.models.llama.hf_config import hf_view as llama_hf_view
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
_MROPE = frozenset({"mrope_section", "mrope_interleaved"})  # equal position streams for text: no effect


_ALIASES = MappingProxyType({"num_local_experts": "num_experts"})  # the MoE classes' attribute_map


def hf_config_to_args(config: dict[str, Any]) -> Qwen35ModelArgs:
    """config.json (as a dict) of one of HF_MODEL_TYPES -> Qwen35ModelArgs, exactly or refused."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise TitanError(f"config.json model_type is {model_type!r}; titan's qwen3_5 reads {', '.join(HF_MODEL_TYPES)}")
    c = HfConfig(config, DEFAULTS[model_type], "qwen3_5", _ALIASES if model_type != "qwen3_5_text" else None)
    c.only("hidden_act", "silu", "the feed-forward is SwiGLU")
    c.only("attention_bias", False, "the q/k/v/o projections have no bias")
    if c.get("attention_dropout") not in (0, 0.0):
        raise c.refuse("attention_dropout", c.get("attention_dropout"), "titan's attention has no dropout")
    if model_type != "qwen3_5_text":
        c.only("output_router_logits", False, "HF's Switch-style balance loss is not titan's aux_loss_coeff")
    n_layers, n_heads = c.int("num_hidden_layers"), c.int("num_attention_heads")
    types = hf_layer_types(c, n_layers)
    if types is None:  # transformers: a full-attention layer every full_attention_interval
        interval = config.get("full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise c.refuse("full_attention_interval", interval, "a positive integer is needed")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if set(types) - set(LAYER_TYPES):
        raise c.refuse("layer_types", types, f"{n_layers} entries of {', '.join(LAYER_TYPES)}")
    default = [("linear_attention" if (i + 1) % 4 else "full_attention") for i in range(n_layers)]
    rope = hf_rope(c, types=("default",), default_theta=_ROPE_THETA, partial=_PARTIAL_ROTARY, ignored=_MROPE)
    moe = model_type != "qwen3_5_text" and c.int("num_experts", minimum=0) > 0
    args = Qwen35ModelArgs(
        dim=c.int("hidden_size"),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=c.int("num_key_value_heads"),
        vocab_size=c.int("vocab_size"),
        head_dim=c.int("head_dim"),
        # Qwen3.5-MoE has no dense feed-forward (every layer routes): its width is the experts'.
        hidden_dim=c.int("moe_intermediate_size" if model_type == "qwen3_5_moe_text" else "intermediate_size"),
        norm_eps=c.number("rms_norm_eps"),
        rope_theta=float(rope["rope_theta"]),
        partial_rotary_factor=rope["partial_rotary_factor"],
        max_seq_len=c.int("max_position_embeddings"),
        tie_embeddings=c.flag("tie_word_embeddings"),
        layer_types=None if types == default else types,  # None: the flavors' every 4th layer
        linear_num_key_heads=c.int("linear_num_key_heads"),
        linear_num_value_heads=c.int("linear_num_value_heads"),
        linear_key_head_dim=c.int("linear_key_head_dim"),
        linear_value_head_dim=c.int("linear_value_head_dim"),
        linear_conv_kernel_dim=c.int("linear_conv_kernel_dim"),
        release="qwen3_next" if model_type == "qwen3_next" else "qwen3_5",
    )
    if moe:
        args.moe_enabled = True
        next_ = model_type == "qwen3_next"  # Qwen3.5-MoE routes every layer and always renormalises
        args.decoder_sparse_step = c.int("decoder_sparse_step") if next_ else 1
        only = c.get("mlp_only_layers") if next_ else None
        if only is not None and (not isinstance(only, list) or not all(isinstance(i, int) for i in only)):
            raise c.refuse("mlp_only_layers", only, "a list of layer indices is needed")
        args.mlp_only_layers = list(only or [])
        args.moe_args = MoEArgs(
            num_experts=c.int("num_experts"),
            num_shared_experts=1,
            shared_hidden_dim=c.int("shared_expert_intermediate_size"),
            shared_expert_gate=True,
            top_k=c.int("num_experts_per_tok"),
            score_func="softmax",
            route_norm=c.flag("norm_topk_prob") if next_ else True,
            score_before_experts=False,
            hidden_dim=c.int("moe_intermediate_size"),
        )
    elif model_type == "qwen3_5_moe_text":
        raise c.refuse("num_experts", c.get("num_experts"), "Qwen3.5-MoE layers all route: at least 1")
    args.validate()
    return args


def hf_view(args: Qwen35ModelArgs) -> Qwen35ModelArgs:
    """``args`` as config.json states them: every layer's type spelled out, the MoE settings only
    for an MoE model (and the dense width only where a layer is dense), Llama 3.1 scaling's only
    when on."""
    args = replace(
        llama_hf_view(args),
        layer_types=[args.layer_type(i) for i in range(args.n_layers)],
        full_attention_interval=Qwen35ModelArgs.full_attention_interval,
    )
    if not args.moe_enabled:
        return reset(args, ("moe_args", "decoder_sparse_step", "mlp_only_layers"))
    if args.decoder_sparse_step == 1 and not args.mlp_only_layers:  # no dense feed-forward: its width is unused
        args = replace(args, hidden_dim=args.moe_args.hidden_dim)
    return replace(args, moe_args=moe_view(args.moe_args))


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
        **hf_shape_fields(args),
        # RoPE on part of each head (the export check refuses Llama 3.1 scaling, which these classes lack)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
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
    if args.mtp_depth > 1:
        raise TitanError(
            f"Hugging Face Qwen3.5 / Qwen3-Next multi-token prediction has one fusion (mtp.fc) for all its layers;"
            f" titan's model.mtp_depth = {args.mtp_depth} has one per depth: export a model with mtp_depth <= 1"
        )
    if args.mtp_depth:
        out["mtp_num_hidden_layers"] = args.mtp_depth  # the releases' field (transformers keeps it as read)
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
