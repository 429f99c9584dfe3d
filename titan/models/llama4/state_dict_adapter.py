"""titan llama4 <-> Hugging Face `Llama4ForCausalLM` (text) state dicts and configs.

Layout differences besides names:
- Routed experts: HF fuses gate and up into ``experts.gate_up_proj`` [E, dim, 2 * hidden] (gate
  first) and stores ``experts.down_proj`` [E, hidden, dim]; titan keeps w1 / w3 [E, hidden, dim]
  and w2 [E, dim, hidden] (x @ w.T per expert, as torchtitan). Pure transposes and a concat: a
  round trip is bitwise lossless. w1 and w3 of a layer must be converted together.
- RoPE: both rotate adjacent feature pairs (complex view), so q/k need no permutation.
- Routing bias: HF has none; the auxiliary-loss-free balancing bias (``moe.expert_bias``) is
  dropped on export (with a warning when it is not zero) and starts at zero on import.
HF's multimodal checkpoints (``language_model.`` prefix) are read as their text model.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import torch

from titan.errors import TitanError
from titan.models.llama.state_dict_adapter import (
    _TOP_MAP_INV,
    _cast,
    args_from_shapes,
    layers_from_hf,
    layers_to_hf,
    unmapped_routing_bias,
    zero_routing_bias,
)
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.llama4.hf_config import args_to_hf_config, hf_config_to_args, hf_view

_LAYER_MAP = MappingProxyType(
    {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
        "feed_forward.w3.weight": "feed_forward.up_proj.weight",
        "feed_forward.w2.weight": "feed_forward.down_proj.weight",
        "moe.router.gate.weight": "feed_forward.router.weight",
        "moe.shared_experts.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
        "moe.shared_experts.w3.weight": "feed_forward.shared_expert.up_proj.weight",
        "moe.shared_experts.w2.weight": "feed_forward.shared_expert.down_proj.weight",
    }
)
_LAYER_INV = MappingProxyType({v: k for k, v in _LAYER_MAP.items()})
_TOP_INV = _TOP_MAP_INV  # embedding, final norm and lm_head are named as in Llama 3


def to_hf(
    state_dict: dict[str, torch.Tensor], model_args: Llama4ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """titan state dict (full tensors; a layer's experts.w1 and w3 together) -> HF keys."""

    def experts(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        prefix = f"model.layers.{layer}.feed_forward.experts"
        if rest == "moe.expert_bias":
            return unmapped_routing_bias(layer, value, "Llama 4", "router scores")
        if rest == "moe.experts.w2":
            return {f"{prefix}.down_proj": _cast(value.transpose(-2, -1), dtype)}
        if rest == "moe.experts.w1":
            w3 = state_dict.get(f"layers.{layer}.moe.experts.w3")
            if w3 is None:
                raise TitanError(f"layers.{layer}.moe.experts.w1 needs its w3 in the same call (HF fuses them)")
            fused = torch.cat([value.transpose(-2, -1), w3.transpose(-2, -1)], -1)
            return {f"{prefix}.gate_up_proj": _cast(fused, dtype)}
        return {} if rest == "moe.experts.w3" else None

    return layers_to_hf(state_dict, model_args, dtype, "Llama 4", _LAYER_MAP, experts)


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_args: Llama4ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF Llama4ForCausalLM (or Llama4ForConditionalGeneration's text) state dict -> titan keys."""
    text = {
        k.removeprefix("language_model."): v
        for k, v in hf_state_dict.items()
        # the image side of multimodal checkpoints
        if not k.removeprefix("language_model.").startswith(("vision_model.", "multi_modal_projector."))
    }

    def experts(layer: str, rest: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if rest == "feed_forward.experts.gate_up_proj":
            gate, up = value.chunk(2, dim=-1)
            return {
                f"layers.{layer}.moe.experts.w1": _cast(gate.transpose(-2, -1).contiguous(), dtype),
                f"layers.{layer}.moe.experts.w3": _cast(up.transpose(-2, -1).contiguous(), dtype),
            }
        if rest == "feed_forward.experts.down_proj":
            return {f"layers.{layer}.moe.experts.w2": _cast(value.transpose(-2, -1).contiguous(), dtype)}
        return None

    out = layers_from_hf(text, model_args, dtype, "Llama 4 text", _LAYER_INV, experts)
    zero_routing_bias(out, model_args.moe_args)
    return out


def state_dict_shapes(args: Llama4ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a full model state dict holds (parameters and the balancing bias), unsharded."""
    from titan.models.llama4.model import Llama4Transformer

    with torch.device("meta"):
        model = Llama4Transformer(replace(args, max_seq_len=1))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class Llama4StateDictAdapter:
    """The registry's handle on this module (ModelSpec.state_dict_adapter)."""

    drops_routing_bias = True  # its HF format has none: an export drops titan's only when told to
    hf_model_types = ("llama4_text", "llama4")
    args_from_shapes = staticmethod(args_from_shapes)
    state_dict_shapes = staticmethod(state_dict_shapes)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    hf_config_to_args = staticmethod(hf_config_to_args)
    args_to_hf_config = staticmethod(args_to_hf_config)
    hf_view = staticmethod(hf_view)
