"""Hugging Face Llama4TextConfig (config.json) <-> Llama4ModelArgs, exact or refused.

Every field of transformers' Llama4TextConfig is either represented exactly, ignored because it
cannot change what the model computes (token ids, caching, init range, router logging), or
refused in one line naming it. A field that is absent takes transformers' default
(HF_DEFAULTS: Llama-4-Scout's text model), never titan's: a config.json without use_qk_norm is
a qk-norm model, as transformers reads it.

How transformers resolves the per-layer settings, mirrored here:
- RoPE per block: no_rope_layers[i] (1: RoPE); empty or absent: NoPE where (i + 1) % no_rope_layer_interval == 0.
- Chunked attention per block: layer_types[i] == "chunked_attention"; absent: the RoPE blocks when
  attention_chunk_size is set. An explicit layer_types wins over no_rope_layers for the mask; RoPE
  still follows no_rope_layers, so a disagreeing pair is honoured block by block.
- MoE per block: moe_layers; absent: every interleave_moe_layer_step-th block.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from titan.errors import TitanError
from titan.models.hf_config import HfConfig, hf_layer_types, moe_view, reset
from titan.models.llama.hf_config import _ffn_settings, hf_shape_fields, with_hf_rope_scaling
from titan.models.llama.hf_config import hf_view as llama_hf_view
from titan.models.llama.model import ffn_hidden_dim
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.moe import MoEArgs

# transformers' Llama4TextConfig defaults (a test checks them against the installed class).
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "moe_layers": None,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layers": None,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "layer_types": None,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
    "attention_bias": False,
}
HF_DEFAULT_ROPE_THETA = 500000.0

# Fields that cannot change the logits or the weights titan loads: token ids, generation cache,
# weight init (titan loads the weights), and router logging (Llama4ForCausalLM adds no aux loss).
IGNORED_FIELDS = frozenset(
    {
        "initializer_range",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
    }
)


def _layers(kind: str, values: Any, n_layers: int) -> list[Any]:
    if not isinstance(values, list) or len(values) < n_layers:
        raise TitanError(
            f"config.json {kind} must be a list with one entry per layer (num_hidden_layers {n_layers}), got {values!r}"
        )
    return values[:n_layers]


def _nope(config: dict[str, Any], n_layers: int) -> list[int]:
    flags = config.get("no_rope_layers")
    if not flags:  # transformers: None or [] -> one NoPE block every no_rope_layer_interval
        interval = config.get("no_rope_layer_interval", HF_DEFAULTS["no_rope_layer_interval"])
        if not isinstance(interval, int) or interval <= 0:
            raise TitanError(f"config.json no_rope_layer_interval must be a positive integer, got {interval!r}")
        return [i for i in range(n_layers) if (i + 1) % interval == 0]
    flags = _layers("no_rope_layers", flags, n_layers)
    if any(f not in (0, 1) for f in flags):
        raise TitanError(f"config.json no_rope_layers must hold 0 (NoPE) or 1 (RoPE) per layer, got {flags}")
    return [i for i, f in enumerate(flags) if not f]


def _chunked(config: dict[str, Any], nope: list[int], n_layers: int) -> list[int]:
    chunk = config.get("attention_chunk_size", HF_DEFAULTS["attention_chunk_size"])
    types = hf_layer_types(HfConfig(config, HF_DEFAULTS, "llama4"), n_layers)
    if types is None:
        return [] if chunk is None else [i for i in range(n_layers) if i not in nope]
    bad = sorted({t for t in types if t not in ("full_attention", "chunked_attention")})
    if bad:
        raise TitanError(
            f"config.json layer_types has {bad}; Llama 4 blocks are 'full_attention' or 'chunked_attention'"
        )
    chunked = [i for i, t in enumerate(types) if t == "chunked_attention"]
    if chunked and chunk is None:
        raise TitanError("config.json layer_types has chunked_attention blocks but attention_chunk_size is null")
    return chunked


def _moe_layout(config: dict[str, Any], n_layers: int) -> dict[str, Any]:
    step = config.get("interleave_moe_layer_step", HF_DEFAULTS["interleave_moe_layer_step"])
    if not isinstance(step, int) or step <= 0:
        raise TitanError(f"config.json interleave_moe_layer_step must be a positive integer, got {step!r}")
    layers = config.get("moe_layers")
    if layers is None:
        return {"interleave_moe_layer_step": step}
    if not isinstance(layers, list) or any(not isinstance(i, int) for i in layers):
        raise TitanError(f"config.json moe_layers must be a list of layer indices, got {layers!r}")
    layers = sorted({i for i in layers if 0 <= i < n_layers})  # transformers ignores the others
    for s in dict.fromkeys((step, *range(1, n_layers + 1))):  # the plain interleave form when there is one
        if layers == list(range(s - 1, n_layers, s)):
            return {"interleave_moe_layer_step": s}
    return {"interleave_moe_layer_step": step, "moe_layers": layers}


def _nope_layout(nope: list[int], n_layers: int) -> dict[str, Any]:
    if not nope:
        return {}
    for n in range(2, n_layers + 1):  # torchtitan's every_n_layers_nope form when there is one
        if nope == [i for i in range(n_layers) if i % n == 0]:
            return {"every_n_layers_nope": n}
    return {"nope_layers": nope}


def hf_config_to_args(config: dict[str, Any]) -> Llama4ModelArgs:
    """HF Llama4TextConfig (config.json as a dict; a Llama4Config's text_config) -> Llama4ModelArgs."""
    if config.get("model_type") == "llama4" and isinstance(config.get("text_config"), dict):
        config = config["text_config"]

    c = HfConfig(config, HF_DEFAULTS, "llama4")
    get = c.get
    c.only("hidden_act", "silu", "the feed-forward is SwiGLU")
    c.only("attention_bias", False, "titan's projections have no bias")
    if get("attention_dropout") not in (0, 0.0):
        raise c.refuse("attention_dropout", get("attention_dropout"), "titan has no attention dropout (0.0)")
    for key in ("use_qk_norm", "attn_temperature_tuning", "tie_word_embeddings"):
        c.flag(key)
    dim, n_heads, n_layers = c.int("hidden_size"), c.int("num_attention_heads"), c.int("num_hidden_layers")
    n_kv = c.int("num_key_value_heads") if get("num_key_value_heads") is not None else n_heads
    head_dim = c.int("head_dim")
    if head_dim * n_heads != dim:
        raise c.refuse("head_dim", head_dim, f"only hidden_size / num_attention_heads ({dim // n_heads})")
    nope = _nope(config, n_layers)
    chunked = _chunked(config, nope, n_layers)
    chunk = get("attention_chunk_size")
    floor_scale = get("floor_scale")
    if not isinstance(floor_scale, int) or floor_scale <= 0:
        raise TitanError(f"config.json floor_scale must be a positive integer, got {floor_scale!r}")
    args = Llama4ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        vocab_size=c.int("vocab_size"),
        norm_eps=c.number("rms_norm_eps"),
        max_seq_len=c.int("max_position_embeddings"),
        tie_embeddings=c.flag("tie_word_embeddings"),
        fixed_attn_block_size=chunk if chunk is not None else Llama4ModelArgs.fixed_attn_block_size,
        use_qk_norm=bool(get("use_qk_norm")),
        attn_temperature_tuning=bool(get("attn_temperature_tuning")),
        floor_scale=floor_scale,
        attn_scale=c.number("attn_scale"),
        moe_args=MoEArgs(
            num_experts=c.int("num_local_experts"),
            top_k=c.int("num_experts_per_tok"),
            num_shared_experts=1,
            score_func="sigmoid",
        ),
        **_moe_layout(config, n_layers),
        **_nope_layout(nope, n_layers),
        **_ffn_settings(dim, c.int("intermediate_size_mlp")),
    )
    if [i for i in range(n_layers) if args.is_chunked(i)] != chunked:
        args.chunked_layers = chunked
    if args.moe_hidden_dim != c.int("intermediate_size"):  # not the width the dense FFN's settings derive
        args.moe_args.hidden_dim = c.int("intermediate_size")
    args = with_hf_rope_scaling(args, c, HF_DEFAULT_ROPE_THETA)
    args.validate()
    return args


def args_to_hf_config(args: Llama4ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Llama4ModelArgs -> a config.json dict that transformers' Llama4ForCausalLM loads. Every
    per-layer setting is written explicitly (moe_layers, no_rope_layers, layer_types)."""
    moe = args.moe_args
    if (
        moe.num_shared_experts != 1
        or moe.score_func != "sigmoid"
        or moe.route_norm
        or moe.route_scale != 1.0
        or moe.gate_bias
    ):
        raise TitanError(
            "Hugging Face Llama 4 routes with sigmoid scores, no normalisation, scale or router bias, and one shared"
            f" expert; this model has score_func {moe.score_func!r}, route_norm {moe.route_norm}, route_scale"
            f" {moe.route_scale}, gate_bias {moe.gate_bias}, num_shared_experts {moe.num_shared_experts}"
        )
    if not moe.score_before_experts:
        raise TitanError("Hugging Face Llama 4 scales the experts' inputs by the router score (score_before_experts)")
    n = args.n_layers
    return {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        **hf_shape_fields(args),
        "intermediate_size": args.moe_hidden_dim,
        "intermediate_size_mlp": ffn_hidden_dim(args),
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "interleave_moe_layer_step": args.interleave_moe_layer_step,
        "moe_layers": [i for i in range(n) if args.is_moe_layer(i)],
        "no_rope_layers": [int(args.uses_rope(i)) for i in range(n)],
        "attention_chunk_size": args.fixed_attn_block_size,
        "layer_types": ["chunked_attention" if args.is_chunked(i) else "full_attention" for i in range(n)],
        "use_qk_norm": args.use_qk_norm,
        "attn_temperature_tuning": args.attn_temperature_tuning,
        "floor_scale": args.floor_scale,
        "attn_scale": args.attn_scale,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_view(args: Llama4ModelArgs) -> Llama4ModelArgs:
    """``args`` as config.json states them: every block's MoE, RoPE and chunking spelled out, the
    experts' effective width, and the settings of a feature no block uses reset."""
    n = args.n_layers
    chunked = [i for i in range(n) if args.is_chunked(i)]
    nope = [i for i in range(n) if not args.uses_rope(i)]
    view = replace(
        llama_hf_view(args),
        interleave_moe_layer_step=1,
        moe_layers=[i for i in range(n) if args.is_moe_layer(i)],
        every_n_layers_nope=None,
        nope_layers=nope,
        chunked_layers=chunked,
        auto_scale_hidden_dim=True,
        moe_args=replace(moe_view(args.moe_args), hidden_dim=args.moe_hidden_dim),
    )
    unused = [] if chunked else ["fixed_attn_block_size"]
    if not (nope and args.attn_temperature_tuning):  # the temperature applies to NoPE blocks only
        unused += ["attn_temperature_tuning", "floor_scale", "attn_scale"]
    return reset(view, unused)


__all__ = ["HF_DEFAULTS", "IGNORED_FIELDS", "args_to_hf_config", "hf_config_to_args", "hf_view"]
