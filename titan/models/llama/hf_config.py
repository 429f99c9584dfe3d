"""Hugging Face LlamaConfig (config.json) <-> TransformerModelArgs, exact or refused in one line.

A field config.json leaves out is transformers' default (LLAMA_DEFAULTS); RoPE is read as
transformers resolves it (titan.models.hf_config.hf_rope): default, or Llama 3.1's frequency
scaling, which qwen3 and llama4 read through the same functions.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from titan.errors import TitanError
from titan.models.hf_config import HfConfig, hf_rope, reset
from titan.models.llama.args import TransformerModelArgs
from titan.models.llama.model import ffn_hidden_dim


def _ffn_settings(dim: int, intermediate: int) -> dict[str, Any]:
    """multiple_of / ffn_dim_multiplier for which titan's SwiGLU width equals `intermediate`."""
    base = int(2 * (4 * dim) / 3)
    multipliers: list[float | None] = [None, 1.3, 1.2, 1.5, 2.0, intermediate / base]
    for mult in multipliers:
        for mult_of in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
            args = TransformerModelArgs(dim=dim, multiple_of=mult_of, ffn_dim_multiplier=mult)
            if ffn_hidden_dim(args) == intermediate:
                return {"multiple_of": mult_of, "ffn_dim_multiplier": mult}
    if base <= intermediate:
        return {"multiple_of": intermediate, "ffn_dim_multiplier": None}  # rounds up to exactly it
    raise TitanError(f"config.json intermediate_size {intermediate} cannot be expressed for hidden_size {dim}")


_Args = TypeVar("_Args", bound=TransformerModelArgs)


def with_hf_rope_scaling(args: _Args, config: HfConfig, default_theta: float) -> _Args:
    """``args`` with config.json's RoPE (``hf_rope``: default, or Llama 3.1's frequency scaling)."""
    rope = hf_rope(config, types=("default", "llama3"), default_theta=default_theta)
    args = replace(args, rope_theta=float(rope["rope_theta"]))
    if rope["rope_type"] == "llama3":
        return replace(
            args,
            use_rope_scaling=True,
            rope_scale_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position_embeddings=rope["original_max_position_embeddings"],
        )
    return args


_LLAMA3_SCALING = (
    "rope_scale_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position_embeddings",
)


def hf_view(args: _Args) -> _Args:
    """``args`` as config.json states them: Llama 3.1 scaling's settings only when it is on."""
    return args if args.use_rope_scaling else reset(args, _LLAMA3_SCALING)


def hf_rope_parameters(args: TransformerModelArgs) -> dict[str, Any]:
    """config.json's rope_parameters for ``args`` (theta, and Llama 3.1's scaling when on)."""
    if not args.use_rope_scaling:
        return {"rope_type": "default", "rope_theta": args.rope_theta}
    return {
        "rope_type": "llama3",
        "rope_theta": args.rope_theta,
        "factor": args.rope_scale_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_position_embeddings,
    }


# transformers 5.24's LlamaConfig defaults for a field config.json leaves out (a test compares them).
LLAMA_DEFAULTS: Any = MappingProxyType(
    dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        pretraining_tp=1,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        head_dim=None,
    )
)


def hf_config_to_args(config: dict[str, Any]) -> TransformerModelArgs:
    """HF LlamaConfig (config.json as a dict) -> TransformerModelArgs, exactly or refused in one
    line; an absent field is transformers' default (LLAMA_DEFAULTS)."""
    if config.get("model_type", "llama") != "llama":
        raise TitanError(f"config.json model_type is {config['model_type']!r}; only 'llama' is supported")
    c = HfConfig(config, LLAMA_DEFAULTS, "llama3")
    c.only("hidden_act", "silu", "the feed-forward is SwiGLU")
    for key in ("attention_bias", "mlp_bias"):
        c.only(key, False, "titan's projections have no bias")
    if c.get("attention_dropout") not in (0, 0.0):
        raise c.refuse("attention_dropout", c.get("attention_dropout"), "titan's attention has no dropout")
    if c.get("pretraining_tp") is not None:
        c.int("pretraining_tp")  # transformers 5 computes the same model for any value
    dim, n_heads = c.int("hidden_size"), c.int("num_attention_heads")
    if c.get("head_dim") is not None and c.get("head_dim") != dim // n_heads:
        raise c.refuse("head_dim", c.get("head_dim"), f"only hidden_size / num_attention_heads ({dim // n_heads})")
    args = TransformerModelArgs(
        dim=dim,
        n_layers=c.int("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=c.int("num_key_value_heads") if c.get("num_key_value_heads") is not None else n_heads,
        vocab_size=c.int("vocab_size"),
        norm_eps=c.number("rms_norm_eps"),
        max_seq_len=c.int("max_position_embeddings"),
        tie_embeddings=c.flag("tie_word_embeddings"),
        **_ffn_settings(dim, c.int("intermediate_size")),
    )
    args = with_hf_rope_scaling(args, c, default_theta=10000.0)
    args.validate()
    return args


def hf_shape_fields(args: TransformerModelArgs) -> dict[str, Any]:
    """The config.json fields every family on llama's skeleton writes alike (widths, depth, heads,
    vocabulary, norm eps, RoPE, context length, tying)."""
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": hf_rope_parameters(args),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
    }


def args_to_hf_config(args: TransformerModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """TransformerModelArgs -> a config.json dict that transformers' LlamaForCausalLM loads."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **hf_shape_fields(args),
        "intermediate_size": ffn_hidden_dim(args),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
