"""The HF folders' self-checks. Import: the folder's tensors must be the model its config.json
describes, before anything is written. Export: the config.json about to be written, read back
through transformers' config class and the family's reader, must describe the model being
exported; and a routing bias the family's HF format cannot hold is refused unless dropping it was
asked for."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from titan.errors import TitanError
from titan.models import spec_for_args

_PER_RUN = ("max_seq_len", "attn_type", "attn_mask_type", "depth_init", "linear_attn_backend")


ROUTING_BIAS = "moe.expert_bias"  # the key suffix of the experts' routing bias (auxiliary-loss-free balancing)


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


def _untold(args: Any, back: Any) -> Any:
    """``back`` with what config.json does not describe taken from ``args``: the per-run settings,
    the SwiGLU width's spelling (the shapes check the width) and how the experts train (the MoE
    settings outside equality, the balancing bias's update rate among them)."""
    keep = {k: getattr(args, k) for k in (*_PER_RUN, "multiple_of", "ffn_dim_multiplier") if hasattr(args, k)}
    back = dataclasses.replace(back, **keep)
    moe = getattr(args, "moe_args", None)
    if moe is not None and getattr(back, "moe_args", None) is not None:
        trained = {f.name: getattr(moe, f.name) for f in dataclasses.fields(moe) if not f.compare}
        back = dataclasses.replace(back, moe_args=dataclasses.replace(back.moe_args, **trained))
    return back


def check_export_config(adapter: Any, args: Any, config: dict[str, Any]) -> None:
    """Stop unless config.json, read back through transformers' config class and the family's
    reader, describes the model being exported: the same tensor shapes and the same settings, each
    side as config.json states it (the adapter's ``hf_view``: settings without effect reset, derived
    ones made explicit)."""
    resolved = _through_transformers(config)
    back = adapter.hf_config_to_args(resolved)
    if type(back) is not type(args):
        raise TitanError(f"HF export refused: config.json reads back as {type(back).__name__}")
    if hasattr(args, "mtp_depth"):  # a load takes the MTP layers a run asks for, not config.json's count
        written = adapter.hf_config_mtp_depth(resolved)
        if written != args.mtp_depth:
            raise TitanError(
                f"HF export refused: config.json says {written} multi-token-prediction layer(s), the model has"
                f" {args.mtp_depth}"
            )
        back = dataclasses.replace(back, mtp_depth=args.mtp_depth)
    back = _untold(args, back)
    if back == args:  # the same model (and so the same shapes)
        return
    a_shapes, b_shapes = adapter.state_dict_shapes(args), adapter.state_dict_shapes(back)
    bad = [k for k in sorted(set(a_shapes) | set(b_shapes)) if a_shapes.get(k) != b_shapes.get(k)]
    if bad:
        raise TitanError(
            f"HF export refused: config.json gives {bad[0]} shape {b_shapes.get(bad[0])}, the model has"
            f" {a_shapes.get(bad[0])}"
        )
    view = getattr(adapter, "hf_view", None) or (lambda a: a)
    model_args, back = view(args), view(back)
    for name in (f.name for f in dataclasses.fields(args)):
        mine, theirs = getattr(model_args, name), getattr(back, name)
        if name == "n_kv_heads":
            mine, theirs = args.kv_heads, back.kv_heads
        elif hasattr(mine, "hidden_dim") and hasattr(args, "moe_hidden_dim"):
            # MoE args: compared at the experts' effective width, however it is spelled
            mine, theirs = copy.copy(mine), copy.copy(theirs)
            mine.hidden_dim = theirs.hidden_dim = args.moe_hidden_dim
        if mine != theirs:
            name, mine, theirs = _first_difference(name, mine, theirs)
            raise TitanError(
                f"HF export refused: config.json reads back with model.{name} = {theirs!r}, the model has {mine!r}"
            )


def _first_difference(name: str, mine: Any, theirs: Any) -> tuple[str, Any, Any]:
    """(name, mine, theirs) of the first differing field of two settings groups (MoE args)."""
    if dataclasses.is_dataclass(mine) and type(mine) is type(theirs):
        for f in dataclasses.fields(mine):
            if f.compare and getattr(mine, f.name) != getattr(theirs, f.name):
                return f"{name}.{f.name}", getattr(mine, f.name), getattr(theirs, f.name)
    return name, mine, theirs


def converted_layout(adapter: Any, hf: dict[str, torch.Tensor], args: Any, where: Any) -> dict[str, torch.Tensor]:
    """``adapter.from_hf`` of a folder's (meta) tensors, refused in one line where their shapes do
    not fit the model config.json describes (a layout step that cannot split them)."""
    try:
        return adapter.from_hf(hf, args)
    except (RuntimeError, ValueError, IndexError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TitanError(f"{where}: {', '.join(hf)} does not fit the model config.json describes ({reason})") from None


def refuse_untied_copy(folder: Any, args: Any) -> None:
    """A tied model's folder may store lm_head.weight too: transformers ties it only when it equals
    the embedding (else it runs the two apart), so a different one is refused."""
    embed = "model.embed_tokens.weight"
    if embed in folder.keys() and not torch.equal(folder.read(embed), folder.read("lm_head.weight")):
        raise TitanError(
            f"{folder.path}: config.json tie_word_embeddings is true but lm_head.weight differs from {embed}"
            " (transformers then unties them); set tie_word_embeddings to false"
        )


__all__ = ["check_export_config", "converted_layout", "refuse_untied_copy"]


def trains_dropped_routing_bias(args: Any) -> bool:
    """True for MoE model args whose balancing trains a routing bias their HF format has no key for."""
    moe = getattr(args, "moe_args", None)
    if moe is None or moe.load_balance_coeff is None:
        return False
    is_moe = getattr(args, "is_moe_layer", None)  # a family whose blocks are all MoE has none
    if is_moe is not None and not any(is_moe(i) for i in range(args.n_layers)):
        return False  # e.g. qwen3's dense flavors
    return bool(getattr(spec_for_args(args).state_dict_adapter, "drops_routing_bias", False))


def check_routing_bias_export(checkpoint: Any, args: Any) -> None:
    """Before any process group: a final HF export that would lose the trained routing bias is
    refused unless checkpoint.hf_drop_routing_bias accepts it (the export would route differently)."""
    if checkpoint.last_save_in_hf and not checkpoint.hf_drop_routing_bias and trains_dropped_routing_bias(args):
        raise TitanError(
            f"checkpoint.last_save_in_hf: Hugging Face {spec_for_args(args).name} has no routing bias, and this run"
            " trains one (auxiliary-loss-free balancing), so the export would pick other experts than the trained"
            " model; set checkpoint.hf_drop_routing_bias = true to export without it, or"
            " model.moe_load_balance_coeff = 0 to train without it"
        )


def refuse_dropped_bias(adapter: Any, state: dict[str, torch.Tensor], family: str) -> None:
    if not getattr(adapter, "drops_routing_bias", False):
        return
    for key, value in state.items():
        if key.endswith(ROUTING_BIAS) and bool(value.abs().max() > 0):
            raise TitanError(
                f"{key} is not zero (max |bias| {float(value.abs().max()):.3g}) and Hugging Face {family} has no"
                " routing bias, so the export would pick other experts than the trained model; pass"
                " --drop_routing_bias (checkpoint.hf_drop_routing_bias = true) to export without it"
            )
