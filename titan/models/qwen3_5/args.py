"""Qwen3.5 hyper-parameters and torchtitan's qwen3_5 flavors (dense and MoE), text decoder only.

A hybrid of two token mixers chosen per layer by ``layer_types`` (Hugging Face's field; None: every
``full_attention_interval``-th layer full attention, the others linear attention):
- "linear_attention": the Gated DeltaNet (titan.models.linear_attention), HK key heads of
  ``linear_key_head_dim`` serving HV value heads of ``linear_value_head_dim``;
- "full_attention": qwen3's attention (per-head q/k norms, its own head_dim) with a per-head
  sigmoid output gate and RoPE on the first ``partial_rotary_factor`` of each head's features.
Every RMSNorm but the DeltaNet's scales by (1 + weight), weights starting at zero. The feed-forward
is a SwiGLU of ``hidden_dim`` or, with ``moe_enabled``, titan's MoE with a sigmoid-gated shared
expert (Qwen3.5-MoE; Qwen3-Next adds decoder_sparse_step / mlp_only_layers, as qwen3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from titan.errors import TitanError
from titan.models.linear_attention import BACKENDS
from titan.models.moe import MoEArgs
from titan.models.moe.flops import active_matmul_params
from titan.models.qwen3.args import Qwen3ModelArgs

LAYER_TYPES = ("linear_attention", "full_attention")
RELEASES = ("qwen3_5", "qwen3_next")


def _moe(num_experts: int, top_k: int, hidden: int, shared: int) -> MoEArgs:
    # Qwen3.5 routing: softmax scores, the top k renormalised, applied to the experts' outputs; one
    # shared expert whose output a per-token sigmoid gate scales.
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=1,
        shared_hidden_dim=shared,
        shared_expert_gate=True,
        top_k=top_k,
        score_func="softmax",
        route_norm=True,
        score_before_experts=False,
        hidden_dim=hidden,
    )


@dataclass
class Qwen35ModelArgs(Qwen3ModelArgs):
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 8
    n_kv_heads: int | None = 2
    vocab_size: int = 248320
    head_dim: int = 256
    hidden_dim: int = 6144
    rope_theta: float = 10_000_000.0
    max_seq_len: int = 262144
    partial_rotary_factor: float = 0.25
    """The share of each attention head's features RoPE rotates (the first ones)."""
    layer_types: list[str] | None = None
    """Each layer's token mixer, "linear_attention" or "full_attention"; None: every
    full_attention_interval-th layer (1-based) full attention, the rest linear."""
    full_attention_interval: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    release: str = "qwen3_5"
    """The Hugging Face architecture its weights read from and export to: qwen3_5
    (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM) or qwen3_next (Qwen3NextForCausalLM, whose
    DeltaNet projections are fused by key-head group). The model is the same."""
    linear_attn_backend: str = "auto"
    """The Gated DeltaNet's path (model.linear_attn_backend): auto, torch or fla."""
    moe_args: MoEArgs = field(default_factory=lambda: _moe(256, 8, 512, 512))
    mtp_depth: int = 0
    """Multi-token-prediction depths (titan.models.mtp; config key model.mtp_depth): each adds one
    full-attention block (layer n_layers + k, the releases' mtp.layers.k) and its fusion parts. 0: none."""

    def validate(self) -> None:
        super().validate()
        for name in (
            "full_attention_interval",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TitanError(f"model.{name} must be a positive integer, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise TitanError(
                f"model.linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of"
                f" model.linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise TitanError(
                f"model.partial_rotary_factor {self.partial_rotary_factor} must leave an even, non-zero number of"
                f" rotated features of head_dim {self.head_dim}"
            )
        if self.layer_types is not None and (
            len(self.layer_types) != self.n_layers or any(t not in LAYER_TYPES for t in self.layer_types)
        ):
            raise TitanError(
                f"model.layer_types must list {self.n_layers} entries of {', '.join(LAYER_TYPES)},"
                f" got {self.layer_types!r}"
            )
        if self.linear_attn_backend not in BACKENDS:
            raise TitanError(
                f"model.linear_attn_backend got {self.linear_attn_backend!r}; valid: {', '.join(BACKENDS)}"
            )
        if not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise TitanError(f"model.mtp_depth must be an integer >= 0, got {self.mtp_depth!r}")
        if self.release not in RELEASES:
            raise TitanError(f"model.release got {self.release!r}; valid: {', '.join(RELEASES)}")
        if self.attn_type == "varlen":
            raise TitanError('model.attn_type = "varlen" is not supported by qwen3_5; valid: sdpa, flex')

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, layer_id: int) -> str:
        if layer_id >= self.n_layers:  # a multi-token-prediction block (the releases' mtp.layers)
            return "full_attention"
        if self.layer_types is not None:
            return self.layer_types[layer_id]
        return "full_attention" if (layer_id + 1) % self.full_attention_interval == 0 else "linear_attention"

    def is_moe_layer(self, layer_id: int) -> bool:
        """A multi-token-prediction block n_layers + k is built as the releases' mtp.layers.k: as if
        it were layer k (transformers' MtpModel and vLLM number it so)."""
        return super().is_moe_layer(layer_id - self.n_layers if layer_id >= self.n_layers else layer_id)

    def check_parallelism(self, tp: int, cp: int) -> None:
        """The layouts the hybrid blocks cannot run, refused by the run plan's check."""
        if cp > 1:
            raise TitanError(
                f"parallelism.context_parallel_degree = {cp} is not supported for qwen3_5: its Gated DeltaNet blocks"
                " carry a recurrent state along the whole sequence, which context parallelism splits; use tensor,"
                " expert, data or pipeline parallelism"
            )
        if tp > 1:
            for name, heads in (("linear_num_key_heads", self.linear_num_key_heads), ("n_kv_heads", self.kv_heads)):
                if heads % tp:
                    raise TitanError(
                        f"parallelism.tensor_parallel_degree {tp} must divide model.{name} ({heads}); pick a"
                        " degree that divides every head count"
                    )


_DEBUG: Mapping[str, Any] = MappingProxyType(
    dict(
        vocab_size=2048, max_seq_len=4096, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
    )
)  # fmt: skip


def _dense(dim: int, n_layers: int, n_heads: int, kv: int, hidden: int, v_heads: int, tied: bool) -> Qwen35ModelArgs:
    return Qwen35ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=kv,
        hidden_dim=hidden,
        linear_num_value_heads=v_heads,
        tie_embeddings=tied,
    )


def _moe_flavor(dim: int, n_layers: int, n_heads: int, v_heads: int, moe: MoEArgs) -> Qwen35ModelArgs:
    return Qwen35ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=2,
        linear_num_value_heads=v_heads,
        hidden_dim=moe.hidden_dim or 0,  # no dense feed-forward: an HF config reads back the experts' width
        moe_enabled=True,
        moe_args=moe,
    )


# torchtitan's qwen3_5 flavors by name and shape, text decoder (read-only; register_flavor adds).
# The small dense releases tie the output to the embedding, as their config.json says.
qwen3_5_configs: Mapping[str, Qwen35ModelArgs] = MappingProxyType(
    {
        "debugmodel": Qwen35ModelArgs(n_layers=8, hidden_dim=512, **_DEBUG),
        "debugmodel_moe": Qwen35ModelArgs(
            n_layers=4, hidden_dim=256, moe_enabled=True, moe_args=_moe(8, 2, 256, 256), **_DEBUG
        ),
        "0.8B": _dense(1024, 24, 8, 2, 3584, 16, tied=True),
        "2B": _dense(2048, 24, 8, 2, 6144, 16, tied=True),
        "4B": _dense(2560, 32, 16, 4, 9216, 32, tied=True),
        "9B": _dense(4096, 32, 16, 4, 12288, 32, tied=False),
        "27B": _dense(5120, 64, 24, 4, 17408, 48, tied=False),
        "35B-A3B": _moe_flavor(2048, 40, 16, 32, _moe(256, 8, 512, 512)),
        "122B-A10B": _moe_flavor(3072, 48, 32, 64, _moe(256, 8, 1024, 1024)),
        "397B-A17B": _moe_flavor(4096, 60, 32, 64, _moe(512, 10, 1024, 1024)),
    }
)


def get_nparams_and_flops(model: nn.Module, seq_len: int) -> tuple[int, int]:
    """All parameters and training FLOPs per token on the active parameters (6 per weight, each
    token through top_k of the routed experts), plus the mixers' own work: 12 * H * Dh * T per full
    attention layer (scores and values, as llama3's count) and, per Gated DeltaNet layer and value
    head, 6 * (2 C (Dk + Dv) + 3 Dk Dv) for the chunked delta rule (C = 64 positions per chunk: the
    within-chunk products and the state's read, correction and update)."""
    args: Qwen35ModelArgs = model.model_args  # type: ignore[assignment]
    ids = [int(i) for i in model.layers.keys()]  # type: ignore[union-attr]
    full = sum(args.layer_type(i) == "full_attention" for i in ids)
    dk, dv, hv = args.linear_key_head_dim, args.linear_value_head_dim, args.linear_num_value_heads
    linear = (len(ids) - full) * hv * 6 * (2 * 64 * (dk + dv) + 3 * dk * dv)
    nparams = sum(p.numel() for p in model.parameters())
    return nparams, 6 * active_matmul_params(model) + 12 * full * args.n_heads * args.head_dim * seq_len + linear


__all__ = ["Qwen35ModelArgs", "get_nparams_and_flops", "qwen3_5_configs"]
