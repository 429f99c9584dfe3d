"""An HF export's self-check: the config.json it is about to write, read back through
transformers' config class and the family's reader, must describe the model being exported."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from titan.errors import TitanError

_PER_RUN = ("max_seq_len", "attn_type", "attn_mask_type", "depth_init")


def _through_transformers(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers' own config class resolves it (its defaults and per-layer
    fields filled in); unchanged where transformers is not installed."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return config
    try:
        resolved = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    except Exception as e:  # transformers refuses what the export would write
        raise TitanError(f"HF export refused: transformers cannot read the config.json it would write ({e})") from None
    return {**resolved.to_dict(), "model_type": config["model_type"]}


def check_export_config(adapter: Any, args: Any, config: dict[str, Any]) -> None:
    """Stop unless config.json, read back through transformers' config class and the family's
    reader, describes the model being exported: the same tensor shapes and the same settings
    (the per-run ones aside, and the SwiGLU width's spelling, which the shapes check)."""
    back = adapter.hf_config_to_args(_through_transformers(config))
    if type(back) is not type(args):
        raise TitanError(f"HF export refused: config.json reads back as {type(back).__name__}")
    a_shapes, b_shapes = adapter.state_dict_shapes(args), adapter.state_dict_shapes(back)
    bad = [k for k in sorted(set(a_shapes) | set(b_shapes)) if a_shapes.get(k) != b_shapes.get(k)]
    if bad:
        raise TitanError(
            f"HF export refused: config.json gives {bad[0]} shape {b_shapes.get(bad[0])}, the model has"
            f" {a_shapes.get(bad[0])}"
        )
    keep = {k: getattr(args, k) for k in (*_PER_RUN, "multiple_of", "ffn_dim_multiplier") if hasattr(args, k)}
    back = dataclasses.replace(back, **keep)
    for name in (f.name for f in dataclasses.fields(args)):
        mine, theirs = getattr(args, name), getattr(back, name)
        if name == "n_kv_heads":
            mine, theirs = args.kv_heads, back.kv_heads
        elif hasattr(mine, "hidden_dim") and hasattr(args, "moe_hidden_dim"):
            # MoE args: compared at the experts' effective width, however it is spelled
            mine, theirs = copy.copy(mine), copy.copy(theirs)
            mine.hidden_dim = theirs.hidden_dim = args.moe_hidden_dim
        if mine != theirs:
            raise TitanError(
                f"HF export refused: config.json reads back with model.{name} = {theirs!r}, the model has {mine!r}"
            )


__all__ = ["check_export_config"]
