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

from collections.abc import Iterable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError
from titan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from titan.models.hf_config import HfConfig, hf_rope, moe_view, reset, yarn_scaling
from titan.models.llama.hf_config import hf_view as llama_hf_view
from titan.models.llama.state_dict_adapter import (
    _cast,
    layers_from_hf,
    layers_to_hf,
    mlp_experts_from_hf,
    mlp_experts_to_hf,
    tied_from_shapes,
)
from titan.models.moe import MoEArgs
from titan.models.mtp import split_mtp_shapes

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
# Multi-token prediction: depth k's fusion parts (titan's mtp.<k>) sit in the release's layer
# n_layers + k beside its block; that layer also stores copies of the shared embedding and head.
_MTP_MAP = MappingProxyType(
    {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
     "norm.weight": "shared_head.norm.weight"}
)  # fmt: skip
_MTP_INV = MappingProxyType({v: k for k, v in _MTP_MAP.items()})
_MTP_SHARED = MappingProxyType(
    {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
)

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
        )},
        **{k: "inert" for k in (
            "output_router_logits", "initializer_range", "use_cache", "pad_token_id", "bos_token_id",
            "eos_token_id", "num_mtp_layers", "pretraining_tp",
        )},
    }
)  # fmt: skip

_HF_LATENT_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm keep their default eps
_ALIASES = MappingProxyType({"num_local_experts": "n_routed_experts", "num_nextn_predict_layers": "num_mtp_layers"})
"""DeepseekV3Config's attribute_map: another name config.json may use -> the field it sets."""


def to_hf(
    state_dict: dict[str, torch.Tensor], model_args: DeepSeekV3ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """titan state dict (full tensors; a layer's experts.w1 and w3 together) -> HF keys."""

    def experts(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if rest == "moe.expert_bias":  # transformers keeps it fp32 whatever the weights' dtype
            return {f"model.layers.{layer}.{_LAYER_MAP[rest]}": value.float()}
        if rest == "moe.router.gate.weight" and model_args.moe_args.load_balance_coeff is None:
            # No balancing bias: transformers' router always adds one, so the export's is zero.
            bias = torch.zeros(model_args.moe_args.num_experts, dtype=torch.float32)
            gate = f"model.layers.{layer}.{_LAYER_MAP[rest]}"
            return {gate: _cast(value, dtype), f"model.layers.{layer}.{_LAYER_MAP['moe.expert_bias']}": bias}
        return mlp_experts_to_hf(state_dict, layer, rest, value, dtype)

    mtp = {k: v for k, v in state_dict.items() if k.startswith("mtp.")}
    out = layers_to_hf(
        {k: v for k, v in state_dict.items() if k not in mtp}, model_args, dtype, "DeepSeek-V3", _LAYER_MAP, experts
    )
    return out | _mtp_to_hf(state_dict, mtp, model_args, dtype)


def _mtp_to_hf(
    state_dict: dict[str, torch.Tensor],
    mtp: dict[str, torch.Tensor],
    args: DeepSeekV3ModelArgs,
    dtype: torch.dtype | None,
) -> dict[str, torch.Tensor]:
    """The MTP fusion parts as the release's layer n_layers + k keys, and beside the embedding and
    the head (in the same call, so in their file) the copies each MTP layer stores of them."""
    out = {}
    for key, value in mtp.items():
        _, k, rest = key.split(".", 2)
        if rest not in _MTP_MAP:
            raise TitanError(f"state dict key {key!r} has no Hugging Face DeepSeek-V3 equivalent")
        out[f"model.layers.{args.n_layers + int(k)}.{_MTP_MAP[rest]}"] = value if dtype is None else value.to(dtype)
    shared = dict(_MTP_SHARED)
    if args.tie_embeddings:  # the export holds the embedding only; the head copy is the same tensor
        shared["shared_head.head.weight"] = "tok_embeddings.weight"
    for hf, titan in shared.items():
        if titan in state_dict:
            value = state_dict[titan] if dtype is None else state_dict[titan].to(dtype)
            # copies: safetensors stores no tensors that share memory
            out |= {f"model.layers.{args.n_layers + k}.{hf}": value.clone() for k in range(args.mtp_depth)}
    return out


def skipped_hf_layer(layer: int, model_args: DeepSeekV3ModelArgs) -> str | None:
    """Why Hugging Face layer ``layer`` is not imported (None: it is), the one place that decides.
    The layers from num_hidden_layers on hold the multi-token-prediction (MTP) modules of
    DeepSeek-V3 and Kimi K2 (their layer 61: embed/enorm/hnorm/eh_proj/shared_head and a decoder
    block); the model's mtp_depth (config key model.mtp_depth) first of them are imported, the
    rest skipped (transformers' DeepseekV3ForCausalLM skips them all)."""
    if layer >= model_args.n_layers + model_args.mtp_depth:
        return f"multi-token prediction, beyond model.mtp_depth = {model_args.mtp_depth}"
    return None


def hf_config_mtp_depth(config: dict[str, Any]) -> int:
    """The MTP layers config.json announces (transformers' num_mtp_layers, stored as
    num_nextn_predict_layers; 1 when absent). save_pretrained writes 1 without any MTP weights: a
    load goes by the weights (hf_mtp_depth), an export's self-check by this."""
    return int(config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1)) or 0)


def hf_mtp_depth(keys: Iterable[str], model_args: DeepSeekV3ModelArgs) -> int:
    """How many MTP layers the weights ``keys`` hold (those from num_hidden_layers on with an eh_proj)."""
    layers = set()
    for key in keys:
        parts = key.split(".")
        if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[3] == "eh_proj":
            layers.add(int(parts[2]))
    return len({i for i in layers if i >= model_args.n_layers})


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_args: DeepSeekV3ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF DeepseekV3ForCausalLM state dict (transformers' in-memory layout) -> titan keys."""

    def special(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if skipped_hf_layer(int(layer), model_args) is not None:
            return {}
        if int(layer) >= model_args.n_layers:  # an MTP layer: its fusion parts, the shared copies, a block
            if rest in _MTP_INV:
                return {
                    f"mtp.{int(layer) - model_args.n_layers}.{_MTP_INV[rest]}": value
                    if dtype is None
                    else value.to(dtype)
                }
            if rest in _MTP_SHARED:
                return {}  # the main model's embedding and head are used
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


def _refuse_unsupported(c: HfConfig) -> None:
    heads = c.get("num_key_value_heads")
    if heads is not None and heads != c.get("num_attention_heads"):  # transformers' model breaks on it too
        raise c.refuse("num_key_value_heads", heads, "latent attention expands keys and values to every head")
    c.only("hidden_act", "silu", "titan's experts are SwiGLU")
    c.only("rope_interleave", True, "titan reads interleaved rotary pairs, as released checkpoints store them")
    c.only("attention_bias", False, "titan's latent attention projections have no bias")
    if c.get("attention_dropout") not in (0, 0.0):
        raise c.refuse("attention_dropout", c.get("attention_dropout"), "titan trains without attention dropout")
    if c.get("pretraining_tp") is not None:
        c.int("pretraining_tp")  # transformers 5 computes the same model for any value


def _routing(c: HfConfig) -> dict[str, Any]:
    """MoEArgs of the router transformers builds: sigmoid scores, the top 2 of each of n_group
    groups rank the groups, topk_group of them are kept."""
    experts, groups, limited = c.int("n_routed_experts"), c.int("n_group"), c.int("topk_group")
    if experts % groups or experts // groups < 2:
        raise c.refuse("n_group", groups, f"groups of at least 2 experts that split n_routed_experts {experts}")
    if limited > groups:
        raise c.refuse("topk_group", limited, f"at most n_group ({groups}) groups can be kept")
    top_k = c.int("num_experts_per_tok")
    if top_k > limited * (experts // groups):
        raise c.refuse(
            "num_experts_per_tok", top_k, f"at most the {limited * (experts // groups)} experts of the kept groups"
        )
    norm = c.get("norm_topk_prob")
    if norm is not None and not isinstance(norm, bool):
        raise c.refuse("norm_topk_prob", norm, "true, false or null (false)")
    return dict(
        num_experts=experts, num_shared_experts=c.int("n_shared_experts", minimum=0), top_k=top_k,
        score_func="sigmoid", route_norm=bool(norm), route_scale=c.number("routed_scaling_factor"),
        score_before_experts=False,
        # All groups kept is no limit at all.
        num_expert_groups=None if limited >= groups else groups,
        num_limited_groups=None if limited >= groups else limited,
    )  # fmt: skip


def _rope_args(c: HfConfig, max_pos: int) -> dict[str, Any]:
    rope = hf_rope(c, types=("default", "yarn"), default_theta=10000.0)
    theta = float(rope["rope_theta"])
    if rope["rope_type"] == "default":
        return dict(rope_theta=theta, use_yarn=False)
    where = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    if rope.get("truncate", True) is not True:
        raise c.refuse(f"{where}.truncate", rope.get("truncate"), "titan's DeepSeek YaRN truncates (true)")
    if rope["factor"] is None and rope.get("mscale_all_dim"):  # transformers' softmax scale needs it
        raise c.refuse(f"{where}.factor", None, "a number beside mscale_all_dim")
    yarn = yarn_scaling(rope, max_pos)
    original = yarn.original_max_position_embeddings
    return dict(
        rope_theta=theta, use_yarn=True, rope_factor=yarn.factor, original_seq_len=original,
        beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=float(rope.get("mscale_all_dim") or 0.0),
        rope_attention_factor=float(yarn.cos_sin_scale()),
    )  # fmt: skip


def hf_config_to_args(config: dict[str, Any]) -> DeepSeekV3ModelArgs:
    """HF DeepseekV3Config (config.json as a dict) -> DeepSeekV3ModelArgs; absent fields are
    transformers' defaults."""
    c = HfConfig(config, TRANSFORMERS_DEFAULTS, "deepseek_v3", aliases=_ALIASES)
    _refuse_unsupported(c)
    n_layers, max_pos = c.int("num_hidden_layers"), c.int("max_position_embeddings")
    q_lora = c.get("q_lora_rank")
    args = DeepSeekV3ModelArgs(
        vocab_size=c.int("vocab_size"), dim=c.int("hidden_size"), inter_dim=c.int("intermediate_size"),
        moe_inter_dim=c.int("moe_intermediate_size"), n_layers=n_layers, n_heads=c.int("num_attention_heads"),
        n_dense_layers=min(c.int("first_k_dense_replace", minimum=0), n_layers), norm_eps=c.number("rms_norm_eps"),
        latent_norm_eps=_HF_LATENT_EPS, max_seq_len=max_pos, tie_embeddings=c.flag("tie_word_embeddings"),
        q_lora_rank=0 if q_lora is None else c.int("q_lora_rank"), kv_lora_rank=c.int("kv_lora_rank"),
        qk_nope_head_dim=c.int("qk_nope_head_dim"), qk_rope_head_dim=c.int("qk_rope_head_dim"),
        v_head_dim=c.int("v_head_dim"), moe_args=MoEArgs(**_routing(c)), **_rope_args(c, max_pos),
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
        "num_nextn_predict_layers": args.mtp_depth, "torch_dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip


_YARN_SETTINGS = ("original_seq_len", "rope_factor", "beta_fast", "beta_slow", "mscale", "rope_attention_factor")


def hf_view(args: DeepSeekV3ModelArgs) -> DeepSeekV3ModelArgs:
    """``args`` as config.json states them: YaRN on or off explicitly (torchtitan derives it from
    the context lengths) and its settings only when on; the experts' width is moe_inter_dim."""
    moe = replace(moe_view(args.moe_args), hidden_dim=None)
    args = replace(llama_hf_view(args), use_yarn=args.yarn_enabled, moe_args=moe)
    return args if args.yarn_enabled else reset(args, _YARN_SETTINGS)


def args_from_shapes(shapes: dict[str, tuple[int, ...]], base: DeepSeekV3ModelArgs, where: str) -> DeepSeekV3ModelArgs:
    """``base`` (a flavor) with vocab_size, n_layers, mtp_depth and tie_embeddings read off a checkpoint's shapes."""
    if "tok_embeddings.weight" not in shapes:
        raise TitanError(f"{where}: no tok_embeddings.weight; cannot infer the model shape")
    vocab, dim = shapes["tok_embeddings.weight"]
    if dim != base.dim:
        raise TitanError(f"{where}: embedding width {dim} is not the flavor's dim {base.dim}; pick the right flavor")
    shapes, depth = split_mtp_shapes(shapes)
    n_layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("layers."))
    args = replace(
        base, vocab_size=vocab, n_layers=n_layers, mtp_depth=depth, tie_embeddings=tied_from_shapes(shapes, base)
    )
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
    hf_mtp_depth = staticmethod(hf_mtp_depth)
    hf_config_mtp_depth = staticmethod(hf_config_mtp_depth)
    args_from_shapes = staticmethod(args_from_shapes)
    state_dict_shapes = staticmethod(state_dict_shapes)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    hf_config_to_args = staticmethod(hf_config_to_args)
    args_to_hf_config = staticmethod(args_to_hf_config)
    hf_view = staticmethod(hf_view)
