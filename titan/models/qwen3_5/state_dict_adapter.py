"""titan qwen3_5 <-> Hugging Face `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` and
`Qwen3NextForCausalLM` state dicts (configs: titan.models.qwen3_5.hf_config).

Attention layers, norms, dense feed-forwards and routed experts map as qwen3's (experts stored one
per key in checkpoints). The Gated DeltaNet keeps q, k, v, z, a and b as separate projections and
q/k/v convolutions (tensor parallelism splits each by heads); Hugging Face fuses them:
- Qwen3.5: ``in_proj_qkv`` = [q; k; v] rows, ``in_proj_z``, ``in_proj_a``, ``in_proj_b``;
- Qwen3-Next: ``in_proj_qkvz`` grouped by key head, [q_h; k_h; v_h; z_h] per head h (the value
  rows of the h-th group of HV / HK value heads), and ``in_proj_ba`` = [b_h; a_h] per key head;
- both: ``conv1d.weight`` [2K + V, 1, W] = the q, k and v convolutions stacked.
Row permutations and concatenations only: a round trip is bitwise. A layer's DeltaNet tensors
convert together (``export_unit`` keeps them in one output file).

Multi-token prediction (titan.models.mtp, model.mtp_depth): the releases store one fusion,
``mtp.fc`` [dim, 2 dim] over [embedding, hidden], ``mtp.pre_fc_norm_embedding`` /
``mtp.pre_fc_norm_hidden`` and ``mtp.norm`` (titan's ``mtp.0.eh_proj`` / ``enorm`` / ``hnorm`` /
``norm``), and its block ``mtp.layers.0`` with a full-attention layer's keys (titan's
``layers.<n_layers>``). Without model.mtp_depth an import skips ``mtp.*`` (``skipped_hf_key``,
one log line); one fusion serves every MTP layer there, so titan reads and writes one depth.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from titan.errors import TitanError
from titan.models.llama.state_dict_adapter import (
    _cast,
    args_from_shapes,
    layers_from_hf,
    layers_to_hf,
    mlp_experts_from_hf,
    mlp_experts_to_hf,
    unmapped_routing_bias,
    zero_routing_bias,
)
from titan.models.mtp import split_mtp_shapes
from titan.models.qwen3.state_dict_adapter import _LAYER_MAP as _QWEN3_MAP
from titan.models.qwen3_5 import hf_config
from titan.models.qwen3_5.args import Qwen35ModelArgs

_LAYER_MAP = MappingProxyType(
    {
        **_QWEN3_MAP,
        "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
        "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
        "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
        "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
        **{f"attention.{k}": f"linear_attn.{k}" for k in ("A_log", "dt_bias", "norm.weight", "out_proj.weight")},
    }
)
_LAYER_INV = MappingProxyType({v: k for k, v in _LAYER_MAP.items()})
_GDN = re.compile(r"^layers\.(\d+)\.attention\.(in_proj_[qkvzab]|conv_[qkv])\.weight$")
_MTP_MAP = MappingProxyType(
    {"eh_proj.weight": "mtp.fc.weight", "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
     "hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "norm.weight": "mtp.norm.weight"}
)  # fmt: skip
_MTP_INV = MappingProxyType({v: k for k, v in _MTP_MAP.items()})
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PARTS = ("q", "k", "v", "z", "a", "b")


def _heads(args: Qwen35ModelArgs) -> tuple[int, int, int, int]:
    return args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim


def _gdn_to_hf(layer: str, parts: dict[str, torch.Tensor], args: Qwen35ModelArgs) -> dict[str, torch.Tensor]:
    hk, hv, dk, dv = _heads(args)
    missing = [f"in_proj_{p}" for p in _PARTS if f"in_proj_{p}" not in parts] + [
        f"conv_{p}" for p in "qkv" if f"conv_{p}" not in parts
    ]
    if missing:
        raise TitanError(
            f"layers.{layer}.attention: {missing[0]} is missing; a layer's Gated DeltaNet converts together"
        )
    p = f"model.layers.{layer}.linear_attn"
    out = {f"{p}.conv1d.weight": torch.cat([parts[f"conv_{c}"] for c in "qkv"]).unsqueeze(1)}
    q, k, v, z, a, b = (parts[f"in_proj_{c}"] for c in _PARTS)
    if args.release == "qwen3_next":
        dim = q.shape[-1]
        grouped = [q.view(hk, dk, dim), k.view(hk, dk, dim), v.view(hk, -1, dim), z.view(hk, -1, dim)]
        out[f"{p}.in_proj_qkvz.weight"] = torch.cat(grouped, dim=1).reshape(-1, dim)
        out[f"{p}.in_proj_ba.weight"] = torch.cat([b.view(hk, -1, dim), a.view(hk, -1, dim)], dim=1).reshape(-1, dim)
    else:
        out |= {f"{p}.in_proj_qkv.weight": torch.cat([q, k, v]), f"{p}.in_proj_z.weight": z}
        out |= {f"{p}.in_proj_a.weight": a, f"{p}.in_proj_b.weight": b}
    return out


def _gdn_from_hf(layer: str, rest: str, value: torch.Tensor, args: Qwen35ModelArgs) -> dict[str, torch.Tensor] | None:
    hk, hv, dk, dv = _heads(args)
    key, value_dim, t = hk * dk, hv * dv, f"layers.{layer}.attention"
    if rest == "linear_attn.conv1d.weight":
        q, k, v = value.squeeze(1).split([key, key, value_dim])
        return {f"{t}.conv_q.weight": q, f"{t}.conv_k.weight": k, f"{t}.conv_v.weight": v}
    if rest == "linear_attn.in_proj_qkv.weight":
        q, k, v = value.split([key, key, value_dim])
        return {f"{t}.in_proj_q.weight": q, f"{t}.in_proj_k.weight": k, f"{t}.in_proj_v.weight": v}
    if rest in ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
        return {f"{t}.{rest.removeprefix('linear_attn.')}": value}
    dim, r = value.shape[-1], hv // hk
    if rest == "linear_attn.in_proj_qkvz.weight":
        q, k, v, z = value.view(hk, -1, dim).split([dk, dk, r * dv, r * dv], dim=1)
        return {f"{t}.in_proj_{n}.weight": x.reshape(-1, dim) for n, x in zip("qkvz", (q, k, v, z))}
    if rest == "linear_attn.in_proj_ba.weight":
        b, a = value.view(hk, 2 * r, dim).split([r, r], dim=1)
        return {f"{t}.in_proj_b.weight": b.reshape(-1, dim), f"{t}.in_proj_a.weight": a.reshape(-1, dim)}
    return None


def to_hf(
    state_dict: dict[str, torch.Tensor], model_args: Qwen35ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """titan state dict (full tensors; a layer's experts and DeltaNet tensors together) -> HF keys."""
    gdn: dict[str, dict[str, torch.Tensor]] = {}
    rest_of_model, mtp = {}, {}
    for key, value in state_dict.items():
        m = _GDN.match(key)
        if key.startswith("mtp."):
            mtp[key] = value
        elif m is None:
            rest_of_model[key] = value
        else:
            gdn.setdefault(m.group(1), {})[m.group(2)] = value
    family = "Qwen3-Next" if model_args.release == "qwen3_next" else "Qwen3.5"

    def layer_key(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if rest == "moe.expert_bias":
            return unmapped_routing_bias(layer, value, family, "router scores")
        return mlp_experts_to_hf(state_dict, layer, rest, value, dtype)

    out = layers_to_hf(rest_of_model, model_args, dtype, family, _LAYER_MAP, layer_key)
    for layer, parts in gdn.items():
        out |= {k: _cast(v.contiguous(), dtype) for k, v in _gdn_to_hf(layer, parts, model_args).items()}
    return {_mtp_block_key(k, model_args.n_layers): v for k, v in out.items()} | _mtp_to_hf(mtp, dtype)


def _mtp_block_key(key: str, n_layers: int) -> str:
    """The releases' key of an HF layer key: an MTP block's (layer n_layers + k) is mtp.layers.k's."""
    m = _HF_LAYER.match(key)
    return f"mtp.layers.{int(m[1]) - n_layers}.{m[2]}" if m is not None and int(m[1]) >= n_layers else key


def _mtp_to_hf(mtp: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in mtp.items():
        _, depth, rest = key.split(".", 2)
        if depth != "0" or rest not in _MTP_MAP:
            raise TitanError(
                f"state dict key {key!r} has no Hugging Face equivalent (its MTP has one fusion: model.mtp_depth <= 1)"
            )
        out[_MTP_MAP[rest]] = _cast(value, dtype)
    return out


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_args: Qwen35ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF Qwen3.5 / Qwen3.5-MoE / Qwen3-Next state dict (transformers' in-memory layout: experts
    fused; any subset of keys, a fused DeltaNet tensor whole) -> titan keys."""

    def layer_key(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        mapped = _gdn_from_hf(layer, rest, value, model_args)
        if mapped is not None:
            return {k: _cast(v.contiguous(), dtype) for k, v in mapped.items()}
        return mlp_experts_from_hf(layer, rest, value, dtype)

    kept, fusion = {}, {}
    for key, value in hf_state_dict.items():
        m = _MTP_LAYER.match(key)
        if skipped_hf_key(key, model_args) is not None:
            continue
        if key in _MTP_INV:
            fusion[f"mtp.0.{_MTP_INV[key]}"] = _cast(value, dtype)
        elif m is not None:  # an MTP block: titan's layer n_layers + k
            kept[f"model.layers.{model_args.n_layers + int(m[1])}.{m[2]}"] = value
        else:
            kept[key] = value
    family = "Qwen3-Next" if model_args.release == "qwen3_next" else "Qwen3.5"
    out = layers_from_hf(kept, model_args, dtype, family, _LAYER_INV, layer_key) | fusion
    if model_args.moe_enabled:
        zero_routing_bias(out, model_args.moe_args)
    return out


def skipped_hf_key(key: str, model_args: Qwen35ModelArgs) -> str | None:
    """Why an HF tensor is not loaded (None: it is), the one place that decides: the releases'
    multi-token-prediction head (mtp.*) beyond the model's mtp_depth (config key model.mtp_depth)."""
    if not key.startswith("mtp."):
        return None
    m = _MTP_LAYER.match(key)
    if model_args.mtp_depth == 0 or (m is not None and int(m[1]) >= model_args.mtp_depth):
        return f"the multi-token-prediction head (mtp.*), beyond model.mtp_depth = {model_args.mtp_depth}"
    return None


def hf_mtp_depth(keys: Iterable[str], model_args: Qwen35ModelArgs) -> int:
    """The MTP depths titan can read from weights ``keys``: 1 with an mtp.fc and an mtp.layers.0
    (the one fusion serves every layer the releases store), else 0."""
    keys = set(keys)
    return int("mtp.fc.weight" in keys and any(k.startswith("mtp.layers.0.") for k in keys))


def hf_config_mtp_depth(config: dict[str, Any]) -> int:
    """The MTP layers config.json announces (mtp_num_hidden_layers, the releases' field; 0 when absent)."""
    return int(config.get("mtp_num_hidden_layers") or 0)


def _args_from_shapes(shapes: dict[str, tuple[int, ...]], base: Qwen35ModelArgs, where: str) -> Qwen35ModelArgs:
    """llama's reading of vocab_size, n_layers and tie_embeddings, with the MTP depths counted apart."""
    main, depth = split_mtp_shapes(shapes)
    args: Any = args_from_shapes(main, base, where)  # the flavor's class: Qwen35ModelArgs
    args = replace(args, mtp_depth=depth)
    args.validate()
    return args


def hf_row_block(key: str, model_args: Qwen35ModelArgs) -> int:
    """Rows of an HF tensor that convert together: all of a fused DeltaNet tensor's (its q, k, v
    (z, b, a) parts lie side by side, so titan's rows sit at an offset in it), one row otherwise."""
    hk, hv, dk, dv = _heads(model_args)
    fused = {
        "linear_attn.in_proj_qkv.weight": 2 * hk * dk + hv * dv,
        "linear_attn.conv1d.weight": 2 * hk * dk + hv * dv,
        "linear_attn.in_proj_qkvz.weight": 2 * hk * dk + 2 * hv * dv,
        "linear_attn.in_proj_ba.weight": 2 * hv,
    }
    return next((rows for name, rows in fused.items() if key.endswith(name)), 1)


def export_unit(key: str) -> str:
    """The titan keys an export writes into one file together: a layer's DeltaNet (fused on the
    HF side), else the module."""
    m = _GDN.match(key)
    return f"layers.{m.group(1)}.attention" if m is not None else key.rsplit(".", 1)[0]


def state_dict_shapes(args: Qwen35ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a full model state dict holds (parameters and the balancing bias), unsharded."""
    from titan.models.qwen3_5.model import Qwen35Transformer

    with torch.device("meta"):
        model = Qwen35Transformer(replace(args, max_seq_len=1))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class Qwen35StateDictAdapter:
    """The registry's handle on this module (ModelSpec.state_dict_adapter)."""

    drops_routing_bias = True  # its HF formats have none: an export drops titan's only when told to
    hf_per_expert = True  # releases store one key per routed expert (written so on export)
    hf_row_block = staticmethod(hf_row_block)
    skipped_hf_key = staticmethod(skipped_hf_key)
    hf_mtp_depth = staticmethod(hf_mtp_depth)
    hf_config_mtp_depth = staticmethod(hf_config_mtp_depth)
    hf_model_types = hf_config.HF_MODEL_TYPES
    args_from_shapes = staticmethod(_args_from_shapes)
    state_dict_shapes = staticmethod(state_dict_shapes)
    export_unit: Callable[[str], str] = staticmethod(export_unit)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    hf_config_to_args: Callable[[dict[str, Any]], Qwen35ModelArgs] = staticmethod(hf_config.hf_config_to_args)
    args_to_hf_config = staticmethod(hf_config.args_to_hf_config)
    hf_view = staticmethod(hf_config.hf_view)
