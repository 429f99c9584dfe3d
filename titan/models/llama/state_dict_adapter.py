"""titan (Meta layout) <-> Hugging Face `LlamaForCausalLM` state dicts and configs.

Two differences besides names:
- RoPE layout. titan (like Meta's reference) rotates adjacent feature pairs (2j, 2j+1) of each
  head; HF's `rotate_half` pairs feature j with j + head_dim/2. The same model therefore needs
  the rows of wq and wk reordered inside every head (`_to_hf_rows` / `_from_hf_rows`). It is a
  pure row permutation, so a round trip is bitwise lossless. wk uses the kv head count (GQA).
- Tied embeddings. HF stores one `model.embed_tokens.weight` and sets `tie_word_embeddings`;
  titan's state dict holds the same tensor under both tok_embeddings and output.

Mapping is per key, so callers may convert any subset of a state dict (e.g. one shard at a
time when exporting a large checkpoint).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError
from titan.models.llama.args import TransformerModelArgs
from titan.models.llama.hf_config import args_to_hf_config, hf_config_to_args, hf_view

_LAYER_MAP = MappingProxyType(
    {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
)
_TOP_MAP = MappingProxyType(
    {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
)
_LAYER_MAP_INV = MappingProxyType({v: k for k, v in _LAYER_MAP.items()})
_TOP_MAP_INV = MappingProxyType({v: k for k, v in _TOP_MAP.items()})
_TITAN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _to_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per head, rows (0,1),(2,3),... (interleaved pairs) -> first halves then second halves."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.view(n_heads, hd // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _from_hf_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``_to_hf_rows`` backwards, on any whole heads' rows (a rank's shard reads only its own)."""
    rows, cols = w.shape
    return w.view(rows // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def hf_row_block(key: str, model_args: TransformerModelArgs) -> int:
    """Rows of an HF tensor that convert together: a head's for q/k (their rows are reordered
    inside each head), one row otherwise."""
    return model_args.head_dim if key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")) else 1


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


LayerKey = Callable[[str, str, torch.Tensor], "dict[str, torch.Tensor] | None"]
"""(layer index, key inside the block, tensor) -> the HF keys it becomes ({} when another key of the
block carries it), or None when the family maps it by its layer table or not at all."""


def layers_to_hf(
    state_dict: dict[str, torch.Tensor],
    model_args: Any,
    dtype: torch.dtype | None,
    family: str,
    layer_map: Mapping[str, str],
    layer_key: LayerKey | None = None,
) -> dict[str, torch.Tensor]:
    """titan -> HF keys for any family on llama's skeleton: the top-level modules (the output left
    out when tied: HF keeps one copy), each block's keys by ``layer_key`` first and ``layer_map``
    next (cast to ``dtype``); a key neither maps is refused in one line naming the family."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in _TOP_MAP:
            if not (key == "output.weight" and model_args.tie_embeddings):
                out[_TOP_MAP[key]] = _cast(value, dtype)
            continue
        m = _TITAN_LAYER.match(key)
        mapped = None
        if m is not None:
            layer, rest = m.groups()
            mapped = layer_key(layer, rest, value) if layer_key is not None else None
            if mapped is None and rest in layer_map:
                mapped = {f"model.layers.{layer}.{layer_map[rest]}": _cast(value, dtype)}
        if mapped is None:
            raise TitanError(f"state dict key {key!r} has no Hugging Face {family} equivalent")
        out.update(mapped)
    return out


def unmapped_routing_bias(layer: str, value: torch.Tensor, family: str, routes_by: str) -> dict[str, torch.Tensor]:
    """The expert bias of titan's balancing, for an HF family without one: dropped (the export
    refused that before unless told to drop it), with a warning when it is not zero (the exported
    model then routes by ``routes_by`` alone)."""
    if bool(value.abs().max() > 0):
        from titan.log import logger

        logger.warning(
            f"layers.{layer}.moe.expert_bias is not zero (max |bias| {float(value.abs().max()):.3g}): Hugging"
            f" Face {family} has no routing bias, so the exported model routes by the {routes_by} alone"
        )
    return {}


def layers_from_hf(
    hf_state_dict: dict[str, torch.Tensor],
    model_args: Any,
    dtype: torch.dtype | None,
    family: str,
    layer_inv: Mapping[str, str],
    layer_key: LayerKey | None = None,
) -> dict[str, torch.Tensor]:
    """HF -> titan keys for any family on llama's skeleton (``layers_to_hf`` backwards): the derived
    RoPE buffer skipped, the top-level modules, each block's keys by ``layer_key`` first and
    ``layer_inv`` next; with tied embeddings output.weight is the embedding tensor itself."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some exports contain; titan derives it
        if key in _TOP_MAP_INV:
            out[_TOP_MAP_INV[key]] = _cast(value, dtype)
            continue
        m = _HF_LAYER.match(key)
        mapped = None
        if m is not None:
            layer, rest = m.groups()
            mapped = layer_key(layer, rest, value) if layer_key is not None else None
            if mapped is None and rest in layer_inv:
                mapped = {f"layers.{layer}.{layer_inv[rest]}": _cast(value, dtype)}
        if mapped is None:
            raise TitanError(f"Hugging Face key {key!r} is not part of a {family} model titan can load")
        out.update(mapped)
    if model_args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def mlp_experts_to_hf(
    state_dict: dict[str, torch.Tensor], layer: str, rest: str, value: torch.Tensor, dtype: torch.dtype | None
) -> dict[str, torch.Tensor] | None:
    """titan's routed experts (w1 / w3 [E, hidden, dim], w2 [E, dim, hidden]; a layer's w1 and w3
    in the same call) as transformers holds DeepSeek-V3's and Qwen3-MoE's: ``mlp.experts.gate_up_proj``
    [E, 2 * hidden, dim] (gate rows first) and ``mlp.experts.down_proj`` [E, dim, hidden]; None for a
    key that is no expert weight. Row slices and a concat: a round trip is bitwise lossless."""
    prefix = f"model.layers.{layer}.mlp.experts"
    if rest == "moe.experts.w2":
        return {f"{prefix}.down_proj": _cast(value, dtype)}
    if rest == "moe.experts.w1":
        w3 = state_dict.get(f"layers.{layer}.moe.experts.w3")
        if w3 is None:
            raise TitanError(f"layers.{layer}.moe.experts.w1 needs its w3 in the same call (HF fuses them)")
        return {f"{prefix}.gate_up_proj": _cast(torch.cat([value, w3], dim=1), dtype)}
    return {} if rest == "moe.experts.w3" else None


def mlp_experts_from_hf(
    layer: str, rest: str, value: torch.Tensor, dtype: torch.dtype | None
) -> dict[str, torch.Tensor] | None:
    """``mlp_experts_to_hf`` backwards (any rows of experts: a rank's shard); None for other keys."""
    if rest == "mlp.experts.gate_up_proj":
        gate, up = value.chunk(2, dim=1)
        return {
            f"layers.{layer}.moe.experts.w1": _cast(gate.contiguous(), dtype),
            f"layers.{layer}.moe.experts.w3": _cast(up.contiguous(), dtype),
        }
    if rest == "mlp.experts.down_proj":
        return {f"layers.{layer}.moe.experts.w2": _cast(value.contiguous(), dtype)}
    return None


def zero_routing_bias(out: dict[str, torch.Tensor], moe_args: Any) -> None:
    """Add titan's balancing bias, at zero, to each MoE block of an imported state dict whose HF
    family has none (nothing when balancing is off)."""
    if moe_args.load_balance_coeff is None:
        return
    for layer in {k.split(".")[1] for k in out if ".moe.router." in k}:
        out[f"layers.{layer}.moe.expert_bias"] = torch.zeros(moe_args.num_experts)


def to_hf(
    state_dict: dict[str, torch.Tensor], model_args: TransformerModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """titan model state dict (full tensors, any subset of keys) -> HF LlamaForCausalLM keys."""

    def rope_rows(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        heads = {"attention.wq.weight": model_args.n_heads, "attention.wk.weight": model_args.kv_heads}
        if rest not in heads:
            return None
        return {f"model.layers.{layer}.{_LAYER_MAP[rest]}": _cast(_to_hf_rows(value, heads[rest]), dtype)}

    return layers_to_hf(state_dict, model_args, dtype, "Llama", _LAYER_MAP, rope_rows)


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_args: TransformerModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM state dict -> titan keys; with tied embeddings output.weight is the
    embedding tensor itself (as in the titan model's own state dict)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some old exports contain; titan derives it from the config
        if key in _TOP_MAP_INV:
            out[_TOP_MAP_INV[key]] = _cast(value, dtype)
            continue
        m = _HF_LAYER.match(key)
        if m is None or m.group(2) not in _LAYER_MAP_INV:
            raise TitanError(
                f"Hugging Face key {key!r} is not part of a Llama model titan can load"
                " (expected model.embed_tokens, model.layers.N.{self_attn,mlp,*_layernorm}, model.norm, lm_head)"
            )
        layer, rest = m.groups()
        if rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            value = _from_hf_rows(value, model_args.head_dim)
        out[f"layers.{layer}.{_LAYER_MAP_INV[rest]}"] = _cast(value, dtype)
    if model_args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def args_from_shapes(
    shapes: dict[str, tuple[int, ...]], base: TransformerModelArgs, where: str
) -> TransformerModelArgs:
    """`base` (a flavor) with vocab_size, n_layers and tie_embeddings read off the tensor shapes
    of a checkpoint (``where`` names it in errors)."""
    if "tok_embeddings.weight" not in shapes:
        raise TitanError(f"{where}: no tok_embeddings.weight; cannot infer the model shape")
    vocab, dim = shapes["tok_embeddings.weight"]
    if dim != base.dim:
        raise TitanError(
            f"{where}: embedding width {dim} does not match the flavor's dim {base.dim}; pick the right flavor"
        )
    n_layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("layers."))
    args = replace(base, vocab_size=vocab, n_layers=n_layers, tie_embeddings=tied_from_shapes(shapes, base))
    args.validate()
    return args


def tied_from_shapes(shapes: dict[str, tuple[int, ...]], base: Any) -> bool:
    """Whether a checkpoint's model ties its output to its embedding: no output.weight, or a tied
    ``base`` (a tied model's state dict, and so its DCP checkpoint, holds the one tensor under both
    names: the tensors alone cannot tell it from an untied one)."""
    return "output.weight" not in shapes or bool(base.tie_embeddings)


def state_dict_shapes(args: TransformerModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a full model state dict holds, with its unsharded shape."""
    from titan.models.llama.meta_checkpoint import full_shapes

    return full_shapes(args)


class LlamaStateDictAdapter:
    """The registry's handle on this module (ModelSpec.state_dict_adapter)."""

    hf_model_types = ("llama",)
    """config.json "model_type" values this adapter reads."""
    hf_row_block = staticmethod(hf_row_block)
    args_from_shapes = staticmethod(args_from_shapes)
    state_dict_shapes = staticmethod(state_dict_shapes)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    hf_config_to_args = staticmethod(hf_config_to_args)
    args_to_hf_config = staticmethod(args_to_hf_config)
    hf_view = staticmethod(hf_view)
