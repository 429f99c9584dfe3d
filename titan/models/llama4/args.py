"""Llama 4 hyper-parameters: Llama 3's attention stack with an MoE feed-forward every
``interleave_moe_layer_step`` blocks (or on the blocks ``moe_layers`` names) and optional iRoPE
(NoPE blocks with full attention, the others attending within fixed blocks). The defaults are
torchtitan's llama4; Meta's released models add a weightless L2 norm of q and k on RoPE blocks
(``use_qk_norm``), attention temperature tuning on NoPE blocks and their own NoPE layout."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from titan.errors import TitanError
from titan.models.llama.args import TransformerModelArgs
from titan.models.moe import MoEArgs
from titan.models.moe.flops import get_nparams_and_flops


@dataclass
class Llama4ModelArgs(TransformerModelArgs):
    vocab_size: int = 202048
    rope_theta: float = 10000.0
    max_seq_len: int = 1048576
    moe_args: MoEArgs = field(default_factory=MoEArgs)
    interleave_moe_layer_step: int = 2
    """Block i has an MoE feed-forward when (i + 1) % step == 0, a dense one otherwise."""
    auto_scale_hidden_dim: bool = True
    """Divide the experts' width by top_k + num_shared_experts, so a token's expert compute matches
    one dense feed-forward."""
    every_n_layers_nope: int | None = None
    """iRoPE: blocks i % n == 0 use no positional embedding (full causal attention); the others use
    RoPE and attend only within their fixed_attn_block_size block. None: RoPE everywhere."""
    fixed_attn_block_size: int = 8192
    moe_layers: list[int] | None = None
    """Blocks with an MoE feed-forward, overriding interleave_moe_layer_step (Hugging Face's
    moe_layers). None: every interleave_moe_layer_step-th block."""
    nope_layers: list[int] | None = None
    """Blocks without positional embedding, overriding every_n_layers_nope (the zeros of Hugging
    Face's no_rope_layers; Meta's released models put them at 3, 7, 11, ...). None: every_n_layers_nope."""
    chunked_layers: list[int] | None = None
    """Blocks attending only within their fixed_attn_block_size block (Hugging Face's layer_types
    "chunked_attention"). None: the RoPE blocks of an iRoPE model (every_n_layers_nope or
    nope_layers set), no block otherwise."""
    use_qk_norm: bool = False
    """Meta's Llama 4: q and k of RoPE blocks are L2-normalised per head after RoPE (no weight,
    eps = norm_eps)."""
    attn_temperature_tuning: bool = False
    """Meta's Llama 4: NoPE blocks scale q at position p by 1 + attn_scale * log(1 + floor((p + 1) /
    floor_scale)), sharpening attention over long contexts."""
    floor_scale: int = 8192
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.moe_args, dict):  # read back from model_args.json
            self.moe_args = MoEArgs(**self.moe_args)

    def validate(self) -> None:
        super().validate()
        self.moe_args.validate()
        for name in ("interleave_moe_layer_step", "fixed_attn_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TitanError(f"model.{name} must be a positive integer, got {value!r}")
        if self.every_n_layers_nope is not None and (
            not isinstance(self.every_n_layers_nope, int) or self.every_n_layers_nope <= 1
        ):
            n = self.every_n_layers_nope
            raise TitanError(f"model.every_n_layers_nope must be an integer > 1 or None, got {n!r}")
        for name in ("moe_layers", "nope_layers", "chunked_layers"):
            layers = getattr(self, name)
            if layers is not None and (
                not isinstance(layers, list)
                or any(not isinstance(i, int) or not 0 <= i < self.n_layers for i in layers)
                or len(set(layers)) != len(layers)
            ):
                raise TitanError(
                    f"model.{name} must be a list of distinct block indices in [0, {self.n_layers}), got {layers!r}"
                )
        if not isinstance(self.floor_scale, int) or self.floor_scale <= 0:
            raise TitanError(f"model.floor_scale must be a positive integer, got {self.floor_scale!r}")
        if self.attn_type == "varlen":
            raise TitanError('model.attn_type = "varlen" is not supported by llama4; valid: sdpa, flex')

    def check_parallelism(self, tp: int, cp: int) -> None:
        """The layouts llama4's attention does not allow, refused by the run plan's check."""
        temperature = self.attn_temperature_tuning and not all(self.uses_rope(i) for i in range(self.n_layers))
        if cp > 1 and (self.any_chunked or temperature):
            raise TitanError(
                f"parallelism.context_parallel_degree = {cp} is not supported for this llama4 flavor: its iRoPE"
                " blocks (chunked attention within fixed_attn_block_size, the NoPE blocks' position temperature)"
                " read absolute positions, which CP's split sequence does not keep; use tensor, expert, data or"
                " pipeline parallelism"
            )

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.moe_layers is not None:
            return layer_id in self.moe_layers
        return (layer_id + 1) % self.interleave_moe_layer_step == 0

    def uses_rope(self, layer_id: int) -> bool:
        if self.nope_layers is not None:
            return layer_id not in self.nope_layers
        return self.every_n_layers_nope is None or layer_id % self.every_n_layers_nope != 0

    def is_chunked(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` attends only within its fixed_attn_block_size block."""
        if self.chunked_layers is not None:
            return layer_id in self.chunked_layers
        irope = self.every_n_layers_nope is not None or self.nope_layers is not None
        return irope and self.uses_rope(layer_id)

    @property
    def any_chunked(self) -> bool:
        return any(self.is_chunked(i) for i in range(self.n_layers))

    @property
    def moe_hidden_dim(self) -> int:
        """Each routed (and shared) expert's SwiGLU width: moe_args.hidden_dim when set (Hugging
        Face configs give it), else derived as torchtitan does."""
        if self.moe_args.hidden_dim is not None:
            return self.moe_args.hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        if self.auto_scale_hidden_dim:
            hidden = int(hidden / (self.moe_args.top_k + self.moe_args.num_shared_experts))
        return hidden + (-hidden % self.multiple_of)


# torchtitan's RoPEScalingArgs() defaults: factor 16, low = high = 1 (a hard cut at 8192 positions).
_ROPE_SCALED: dict[str, Any] = dict(
    use_rope_scaling=True,
    rope_scale_factor=16.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=1.0,
    rope_original_max_position_embeddings=8192,
)
_IROPE: dict[str, Any] = dict(every_n_layers_nope=4, attn_type="flex", attn_mask_type="block_causal")


def _debug(**kw: Any) -> Llama4ModelArgs:
    return Llama4ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000.0, **_ROPE_SCALED, **kw)


def _17b(num_experts: int, **kw: Any) -> Llama4ModelArgs:
    return Llama4ModelArgs(
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=2048,
        rope_theta=500000.0,
        moe_args=MoEArgs(num_experts=num_experts),
        **kw,
    )


# torchtitan v0.2.2's llama4 flavors by name and shape (read-only; titan.models.register_flavor adds).
# The 16-expert shapes (Scout) interleave MoE in every block and scale RoPE; the 128-expert ones
# (Maverick) every second block, unscaled.
llama4_configs: Mapping[str, Llama4ModelArgs] = MappingProxyType(
    {
        "debugmodel": _debug(),
        "17bx16e": _17b(16, **_ROPE_SCALED, max_seq_len=10485760, interleave_moe_layer_step=1),
        "17bx128e": _17b(128),
        "debugmodel_irope": _debug(**_IROPE, fixed_attn_block_size=256),
        "17bx16e_irope": _17b(16, **_ROPE_SCALED, **_IROPE, max_seq_len=10485760, interleave_moe_layer_step=1),
        "17bx128e_irope": _17b(128, **_IROPE),
    }
)


__all__ = ["Llama4ModelArgs", "get_nparams_and_flops", "llama4_configs"]
