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
from typing import Any

import torch

from titan.errors import TitanError
from titan.log import logger
from titan.models.llama.model import ffn_hidden_dim
from titan.models.llama.state_dict_adapter import (
    _HF_LAYER,
    _TITAN_LAYER,
    _TOP_MAP,
    _TOP_MAP_INV,
    _cast,
    _ffn_settings,
    args_from_shapes,
    hf_rope,
    hf_rope_scaling,
    with_hf_rope_scaling,
)
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.moe import MoEArgs

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
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in _TOP_MAP:
            if not (key == "output.weight" and model_args.tie_embeddings):
                out[_TOP_MAP[key]] = _cast(value, dtype)
            continue
        m = _TITAN_LAYER.match(key)
        if m is None:
            raise TitanError(f"state dict key {key!r} has no Hugging Face Llama 4 equivalent")
        layer, rest = m.groups()
        prefix = f"model.layers.{layer}.feed_forward.experts"
        if rest in _LAYER_MAP:
            out[f"model.layers.{layer}.{_LAYER_MAP[rest]}"] = _cast(value, dtype)
        elif rest == "moe.expert_bias":
            if bool(value.abs().max() > 0):
                logger.warning(
                    f"layers.{layer}.moe.expert_bias is not zero (max |bias| {float(value.abs().max()):.3g}): Hugging"
                    " Face Llama 4 has no routing bias, so the exported model routes by the router scores alone"
                )
        elif rest == "moe.experts.w2":
            out[f"{prefix}.down_proj"] = _cast(value.transpose(-2, -1), dtype)
        elif rest == "moe.experts.w1":
            w3 = state_dict.get(f"layers.{layer}.moe.experts.w3")
            if w3 is None:
                raise TitanError(f"layers.{layer}.moe.experts.w1 needs its w3 in the same call (HF fuses them)")
            out[f"{prefix}.gate_up_proj"] = _cast(torch.cat([value.transpose(-2, -1), w3.transpose(-2, -1)], -1), dtype)
        elif rest != "moe.experts.w3":
            raise TitanError(f"state dict key {key!r} has no Hugging Face Llama 4 equivalent")
    return out


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], model_args: Llama4ModelArgs, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """HF Llama4ForCausalLM (or Llama4ForConditionalGeneration's text) state dict -> titan keys."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        key = key.removeprefix("language_model.")
        if key.startswith(("vision_model.", "multi_modal_projector.")) or key.endswith("rotary_emb.inv_freq"):
            continue  # the image side of multimodal checkpoints; a buffer titan derives
        if key in _TOP_INV:
            out[_TOP_INV[key]] = _cast(value, dtype)
            continue
        m = _HF_LAYER.match(key)
        if m is None:
            raise TitanError(f"Hugging Face key {key!r} is not part of a Llama 4 text model titan can load")
        layer, rest = m.groups()
        if rest in _LAYER_INV:
            out[f"layers.{layer}.{_LAYER_INV[rest]}"] = _cast(value, dtype)
        elif rest == "feed_forward.experts.gate_up_proj":
            gate, up = value.chunk(2, dim=-1)
            out[f"layers.{layer}.moe.experts.w1"] = _cast(gate.transpose(-2, -1).contiguous(), dtype)
            out[f"layers.{layer}.moe.experts.w3"] = _cast(up.transpose(-2, -1).contiguous(), dtype)
        elif rest == "feed_forward.experts.down_proj":
            out[f"layers.{layer}.moe.experts.w2"] = _cast(value.transpose(-2, -1).contiguous(), dtype)
        else:
            raise TitanError(f"Hugging Face key {key!r} is not part of a Llama 4 text model titan can load")
    if model_args.moe_args.load_balance_coeff is not None:  # the balancing bias starts at zero
        for layer in {int(k.split(".")[1]) for k in out if ".moe.router." in k}:
            out[f"layers.{layer}.moe.expert_bias"] = torch.zeros(model_args.moe_args.num_experts)
    if model_args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def _nope_every(no_rope_layers: list[int], n_layers: int) -> int | None:
    """titan's every_n_layers_nope for HF's per-layer RoPE flags (1: RoPE), or refuse."""
    if all(no_rope_layers[:n_layers]):
        return None
    for n in range(2, n_layers + 1):
        if [int(i % n != 0) for i in range(n_layers)] == list(no_rope_layers[:n_layers]):
            return n
    raise TitanError(
        f"config.json no_rope_layers {no_rope_layers[:n_layers]} is not supported: titan's llama4 (as torchtitan's)"
        " puts the NoPE layers at 0, n, 2n, ... (every_n_layers_nope = n)"
    )


def hf_config_to_args(config: dict[str, Any]) -> Llama4ModelArgs:
    """HF Llama4TextConfig (config.json as a dict; a Llama4Config's text_config) -> Llama4ModelArgs."""
    if config.get("model_type") == "llama4" and isinstance(config.get("text_config"), dict):
        config = config["text_config"]

    def need(key: str) -> Any:
        if key not in config:
            raise TitanError(f"config.json has no {key!r}; is this a Llama 4 (Llama4ForCausalLM) checkpoint?")
        return config[key]

    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("use_qk_norm", False)):
        if config.get(key, ok) != ok:
            raise TitanError(f"config.json {key} is {config[key]!r}; titan's llama4 supports only {ok!r}")
    if config.get("attn_temperature_tuning", False):
        raise TitanError(
            "config.json attn_temperature_tuning is true; titan's llama4 (as torchtitan's) has no NoPE-layer"
            " attention temperature: set it to false"
        )
    dim, n_heads, n_layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    if config.get("head_dim") not in (None, dim // n_heads):
        raise TitanError(f"config.json head_dim {config['head_dim']} != hidden_size / num_attention_heads")
    step = int(config.get("interleave_moe_layer_step", 1))
    moe_layers = config.get("moe_layers")
    if moe_layers is not None and list(moe_layers) != list(range(step - 1, n_layers, step)):
        raise TitanError(f"config.json moe_layers {moe_layers} is not every interleave_moe_layer_step ({step}) layers")
    rope_flags = config.get("no_rope_layers") or [
        int((i + 1) % config.get("no_rope_layer_interval", 4) != 0) for i in range(n_layers)
    ]
    nope = _nope_every(rope_flags, n_layers)
    chunk = config.get("attention_chunk_size")
    if nope is None and chunk is not None and chunk < config.get("max_position_embeddings", chunk + 1):
        raise TitanError(
            "config.json attention_chunk_size is set without NoPE layers; titan's llama4 chunks attention"
            " only in iRoPE models"
        )
    rope = hf_rope(config)
    theta = float(config.get("rope_theta", rope.get("rope_theta", 500000.0)))
    args = Llama4ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=need("vocab_size"),
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        max_seq_len=config.get("max_position_embeddings", 131072),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        interleave_moe_layer_step=step,
        every_n_layers_nope=nope,
        fixed_attn_block_size=chunk if nope is not None and chunk is not None else 8192,
        moe_args=MoEArgs(
            num_experts=need("num_local_experts"),
            top_k=config.get("num_experts_per_tok", 1),
            num_shared_experts=1,
            score_func="sigmoid",
        ),
        **_ffn_settings(dim, need("intermediate_size_mlp")),
    )
    if args.moe_hidden_dim != need("intermediate_size"):  # not the width the dense FFN's settings derive
        args.moe_args.hidden_dim = config["intermediate_size"]
    args = with_hf_rope_scaling(args, rope)
    args.validate()
    return args


def args_to_hf_config(args: Llama4ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Llama4ModelArgs -> a config.json dict that transformers' Llama4ForCausalLM loads."""
    moe = args.moe_args
    if moe.num_shared_experts != 1 or moe.score_func != "sigmoid" or moe.route_norm or moe.route_scale != 1.0:
        raise TitanError(
            "Hugging Face Llama 4 routes with sigmoid scores, no normalisation or scale, and one shared expert;"
            f" this model has score_func {moe.score_func!r}, route_norm {moe.route_norm}, route_scale"
            f" {moe.route_scale}, num_shared_experts {moe.num_shared_experts}"
        )
    if not moe.score_before_experts:
        raise TitanError("Hugging Face Llama 4 scales the experts' inputs by the router score (score_before_experts)")
    rope: dict[str, Any] = {"rope_type": "default", **(hf_rope_scaling(args) or {}), "rope_theta": args.rope_theta}
    irope = args.every_n_layers_nope is not None
    return {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "hidden_size": args.dim,
        "intermediate_size": args.moe_hidden_dim,
        "intermediate_size_mlp": ffn_hidden_dim(args),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "interleave_moe_layer_step": args.interleave_moe_layer_step,
        "moe_layers": [i for i in range(args.n_layers) if args.is_moe_layer(i)],
        "no_rope_layers": [int(args.uses_rope(i)) for i in range(args.n_layers)],
        "attention_chunk_size": args.fixed_attn_block_size if irope else None,
        "use_qk_norm": False,
        "attn_temperature_tuning": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def state_dict_shapes(args: Llama4ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a full model state dict holds (parameters and the balancing bias), unsharded."""
    from titan.models.llama4.model import Llama4Transformer

    with torch.device("meta"):
        model = Llama4Transformer(replace(args, max_seq_len=1))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class Llama4StateDictAdapter:
    """The registry's handle on this module (ModelSpec.state_dict_adapter)."""

    hf_model_types = ("llama4_text", "llama4")
    args_from_shapes = staticmethod(args_from_shapes)
    state_dict_shapes = staticmethod(state_dict_shapes)
    to_hf = staticmethod(to_hf)
    from_hf = staticmethod(from_hf)
    hf_config_to_args = staticmethod(hf_config_to_args)
    args_to_hf_config = staticmethod(args_to_hf_config)
