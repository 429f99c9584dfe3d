"""gpt-oss hyper-parameters (torchtitan's gpt_oss family, OpenAI's gpt-oss release): grouped-query
attention with biases and learned per-head sinks, sliding-window attention on alternating layers,
YaRN RoPE, and an MoE feed-forward in every block (experts with biases and a clamped SwiGLU, softmax
routing over the top-k logits)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from titan.errors import TitanError
from titan.models.llama.args import TransformerModelArgs
from titan.models.moe import MoEArgs
from titan.models.moe.flops import active_matmul_params
from titan.models.rope import YarnScaling

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("yarn", "default")


def gpt_oss_moe(num_experts: int) -> MoEArgs:
    """torchtitan's routing for gpt-oss: softmax scores renormalised over the top 4 (= a softmax over
    the top-4 logits, as the release), a gate bias, scores applied to the experts' outputs."""
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        top_k=4,
        score_func="softmax",
        route_norm=True,
        gate_bias=True,
        score_before_experts=False,
        experts_bias=True,
        swiglu_limit=7.0,
        hidden_dim=2880,
    )


@dataclass
class GptOssModelArgs(TransformerModelArgs):
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int | None = 8
    head_dim: int = 64  # type: ignore[assignment]  # its own width, not dim // n_heads
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    max_seq_len: int = 131072
    moe_args: MoEArgs = field(default_factory=lambda: gpt_oss_moe(32))
    attention_bias: bool = True
    """Biases on the q/k/v/o projections (the release has them)."""
    sliding_window_size: int | None = 128
    """Keys a sliding-window layer's query sees, itself included (q - k < window); None: every layer
    attends over the whole causal window."""
    layer_types: list[str] | None = None
    """Per layer "sliding_attention" or "full_attention"; None: sliding on even layers (0, 2, ...)."""
    rope_type: str = "yarn"
    """yarn (the release's context extension) or default (plain RoPE)."""
    rope_factor: float = 32.0
    original_seq_len: int = 4096
    ntk_alpha: float = 1.0
    """YaRN's beta_slow: pairs turning less than this over original_seq_len are interpolated."""
    ntk_beta: float = 32.0
    """YaRN's beta_fast: pairs turning more than this keep their frequency."""
    rope_truncate: bool = False
    rope_attention_factor: float | None = None
    """cos/sin scale; None: YaRN's 0.1 ln(factor) + 1."""

    def __post_init__(self) -> None:
        if isinstance(self.moe_args, dict):  # read back from model_args.json
            self.moe_args = MoEArgs(**self.moe_args)

    def is_sliding(self, layer_id: int) -> bool:
        if self.sliding_window_size is None:
            return False
        if self.layer_types is None:
            return layer_id % 2 == 0
        return self.layer_types[layer_id] == "sliding_attention"

    def yarn(self) -> YarnScaling | None:
        if self.rope_type != "yarn":
            return None
        return YarnScaling(
            factor=self.rope_factor,
            original_max_position_embeddings=self.original_seq_len,
            beta_fast=self.ntk_beta,
            beta_slow=self.ntk_alpha,
            truncate=self.rope_truncate,
            attention_factor=self.rope_attention_factor,
        )

    def check_parallelism(self, tp: int, cp: int) -> None:
        """The layouts gpt-oss cannot run, refused by the run plan's check (before any process
        group): CP, and a TP degree that does not split whole heads and the experts' width."""
        widths = (("n_heads", self.n_heads), ("n_kv_heads", self.kv_heads))
        for name, value in (*widths, ("moe_args.hidden_dim", self.moe_args.hidden_dim or 0)):
            if tp > 1 and value % tp:
                raise TitanError(
                    f"parallelism.tensor_parallel_degree = {tp} must divide model.{name} ({value}) for"
                    ' model.name = "gpt_oss" (TP splits whole heads and the experts\' hidden dim); pick a divisor'
                )
        if cp > 1:
            raise TitanError(
                f"parallelism.context_parallel_degree = {cp} is not supported for model.name ="
                ' "gpt_oss" (the attention sinks need each query\'s keys on one rank); use expert, data or pipeline'
                " parallelism"
            )

    def validate(self) -> None:
        if not isinstance(self.head_dim, int) or self.head_dim <= 0 or self.head_dim % 2:
            raise TitanError(f"model.head_dim must be a positive even integer (RoPE pairs), got {self.head_dim!r}")
        # The parent checks dim % n_heads and an even dim // n_heads: gpt-oss's heads have their own
        # width (64 x 64 heads on a 2880 model), so only the rest of its checks apply.
        saved = self.dim
        self.dim = self.n_heads * 2
        try:
            super().validate()
        finally:
            self.dim = saved
        if not isinstance(self.dim, int) or self.dim <= 0:
            raise TitanError(f"model.dim must be a positive integer, got {self.dim!r}")
        self.moe_args.validate()
        if self.moe_args.num_shared_experts:
            raise TitanError("model.moe_args.num_shared_experts must be 0 for gpt_oss (its MoE has no shared expert)")
        if self.moe_args.hidden_dim is None:
            raise TitanError("model.moe_args.hidden_dim must be set for gpt_oss (the experts' width)")
        if self.sliding_window_size is not None and (
            not isinstance(self.sliding_window_size, int) or self.sliding_window_size <= 0
        ):
            window = self.sliding_window_size
            raise TitanError(f"model.sliding_window_size must be a positive integer or None, got {window!r}")
        if self.layer_types is not None and (
            len(self.layer_types) != self.n_layers or any(t not in LAYER_TYPES for t in self.layer_types)
        ):
            raise TitanError(
                f"model.layer_types must list {self.n_layers} entries from {', '.join(LAYER_TYPES)},"
                f" got {self.layer_types!r}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise TitanError(f"model.rope_type must be one of {', '.join(ROPE_TYPES)}, got {self.rope_type!r}")
        if self.rope_type == "yarn" and (self.rope_factor <= 1 or self.original_seq_len <= 0 or self.ntk_alpha <= 0):
            raise TitanError(
                "model YaRN RoPE needs rope_factor > 1, original_seq_len > 0 and ntk_alpha > 0, got"
                f" {self.rope_factor!r}, {self.original_seq_len!r}, {self.ntk_alpha!r}"
            )
        if self.attn_type == "varlen":
            raise TitanError('model.attn_type = "varlen" is not supported by gpt_oss (no sinks); valid: sdpa, flex')
        if self.use_rope_scaling:
            raise TitanError("model.use_rope_scaling (Llama 3.1 scaling) does not apply to gpt_oss; it uses YaRN")


def _flavor(n_layers: int, num_experts: int, **kw: Any) -> GptOssModelArgs:
    return GptOssModelArgs(n_layers=n_layers, moe_args=gpt_oss_moe(num_experts), **kw)


# torchtitan v0.2.2's gpt_oss flavors by name and shape (read-only; titan.models.register_flavor
# adds). The debug model keeps the release's heads, vocabulary and expert width on 4 layers of 256.
gpt_oss_configs: Mapping[str, GptOssModelArgs] = MappingProxyType(
    {
        "debugmodel": _flavor(4, 8, dim=256),
        "20b": _flavor(24, 32),
        "120b": _flavor(36, 128),
    }
)


def get_nparams_and_flops(model: nn.Module, seq_len: int) -> tuple[int, int]:
    """All parameters and training FLOPs per token on the ACTIVE ones: 6 * (dense non-embedding +
    experts * top_k / num_experts) + 12 * H * Dh * (keys a query sees) per layer: the whole window
    T on full-attention layers, min(window, T) on sliding-window ones (the causal half is not
    discounted, as for llama3)."""
    args: GptOssModelArgs = model.model_args  # type: ignore[assignment]
    attn = 0
    for name in model.layers:  # type: ignore[attr-defined]  # a pipeline stage holds some layers
        keys = min(args.sliding_window_size, seq_len) if args.is_sliding(int(name)) else seq_len  # type: ignore[type-var]
        attn += 12 * args.n_heads * args.head_dim * keys
    return sum(p.numel() for p in model.parameters()), 6 * active_matmul_params(model) + attn


__all__ = ["GptOssModelArgs", "get_nparams_and_flops", "gpt_oss_configs", "gpt_oss_moe"]
