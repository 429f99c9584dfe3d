"""Qwen3 hyper-parameters and torchtitan v0.2.2's qwen3 flavors (dense and MoE).

Qwen3 is Llama 3's skeleton with a per-head RMSNorm on queries and keys, a head width of its own
(``head_dim``, not ``dim // n_heads``), an explicit SwiGLU width (``hidden_dim``) and, in the MoE
variant, titan's MoE layer (softmax top-k with the chosen scores renormalised, no shared expert,
experts ``moe_args.hidden_dim`` wide) in every ``decoder_sparse_step``-th block but ``mlp_only_layers``.
"""

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
class Qwen3ModelArgs(TransformerModelArgs):
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int | None = 8
    vocab_size: int = 151936
    head_dim: int = 128  # type: ignore[assignment]  # a field here: the width is the model's own
    hidden_dim: int = 3072
    """The dense SwiGLU width (HF intermediate_size); multiple_of / ffn_dim_multiplier do not apply."""
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 4096
    moe_enabled: bool = False
    moe_args: MoEArgs = field(default_factory=lambda: _moe(8, 768))
    """The routed experts' layer; moe_args.hidden_dim is the experts' width (HF moe_intermediate_size)."""
    decoder_sparse_step: int = 1
    """With moe_enabled, block i has the MoE feed-forward when (i + 1) % step == 0 (HF's rule)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """With moe_enabled, these blocks keep the dense feed-forward (HF's mlp_only_layers)."""

    def __post_init__(self) -> None:
        if isinstance(self.moe_args, dict):  # read back from model_args.json
            self.moe_args = MoEArgs(**self.moe_args)
        self.mlp_only_layers = list(self.mlp_only_layers)

    def validate(self) -> None:
        super().validate()
        for name in ("head_dim", "hidden_dim", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TitanError(f"model.{name} must be a positive integer, got {value!r}")
        if self.ffn_dim_multiplier is not None:
            raise TitanError("model.ffn_dim_multiplier does not apply to qwen3 (model.hidden_dim is the width)")
        if self.moe_enabled:
            self.moe_args.validate()
            if self.moe_args.hidden_dim is None:
                raise TitanError("qwen3 with moe_enabled needs model.moe_args.hidden_dim (the experts' width)")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
            if bad:
                raise TitanError(f"model.mlp_only_layers {bad} are not layers of a {self.n_layers}-layer model")

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            self.moe_enabled and layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0
        )


def _moe(num_experts: int, hidden: int) -> MoEArgs:
    # torchtitan's qwen3 MoE routing: softmax scores, the top 8 renormalised, applied to the
    # experts' outputs, no shared expert.
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        top_k=8,
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        score_before_experts=False,
        hidden_dim=hidden,
    )


_COMMON: Mapping[str, Any] = MappingProxyType(dict(vocab_size=151936, max_seq_len=4096, head_dim=128, rope_theta=1e6))
_DEBUG: Mapping[str, Any] = MappingProxyType(
    dict(vocab_size=2048, max_seq_len=4096, head_dim=128, dim=256, n_layers=8, n_heads=16, n_kv_heads=8)
)


def _dense(dim: int, n_layers: int, n_heads: int, hidden: int, tied: bool) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, hidden_dim=hidden, tie_embeddings=tied, **_COMMON
    )


# torchtitan v0.2.2's qwen3 flavors by name and shape (read-only; titan.models.register_flavor adds).
qwen3_configs: Mapping[str, Qwen3ModelArgs] = MappingProxyType(
    {
        "debugmodel": Qwen3ModelArgs(hidden_dim=3072, rope_theta=1e6, tie_embeddings=True, **_DEBUG),
        "0.6B": _dense(1024, 28, 16, 3072, tied=True),
        "1.7B": _dense(2048, 28, 16, 6144, tied=True),
        "4B": _dense(2560, 36, 32, 9728, tied=True),
        "8B": _dense(4096, 36, 32, 12288, tied=False),
        "14B": _dense(5120, 40, 40, 17408, tied=False),
        "32B": _dense(5120, 64, 64, 25600, tied=False),
        "debugmodel_moe": Qwen3ModelArgs(
            hidden_dim=3072, rope_theta=1e6, moe_enabled=True, moe_args=_moe(64, 768), **_DEBUG
        ),
        "30B-A3B": Qwen3ModelArgs(
            vocab_size=151936,
            max_seq_len=262144,
            head_dim=128,
            dim=2048,
            n_layers=48,
            n_heads=32,
            n_kv_heads=4,
            hidden_dim=6144,
            rope_theta=1e6,
            moe_enabled=True,
            moe_args=_moe(128, 768),
        ),
        "235B-A22B": Qwen3ModelArgs(
            vocab_size=151936,
            max_seq_len=4096,
            head_dim=128,
            dim=4096,
            n_layers=94,
            n_heads=64,
            n_kv_heads=4,
            hidden_dim=12288,
            rope_theta=5e6,
            moe_enabled=True,
            moe_args=_moe(128, 1536),
        ),
    }
)

__all__ = ["Qwen3ModelArgs", "get_nparams_and_flops", "qwen3_configs"]
