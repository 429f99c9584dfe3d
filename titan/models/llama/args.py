"""Llama 3 / 3.1 hyper-parameters, the published flavors, and parameter / FLOP counting."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from torch import nn

from titan.config.choices import AttnMaskType, AttnType, choices
from titan.errors import TitanError

_ATTN_TYPES = choices(AttnType)
_ATTN_MASK_TYPES = choices(AttnMaskType)


@dataclass
class TransformerModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    vocab_size: int = 128256
    multiple_of: int = 256
    """The SwiGLU hidden size is rounded up to a multiple of this (matmul-friendly shapes)."""
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_rope_scaling: bool = False
    """Llama 3.1 long-context frequency scaling (the four rope_* fields below)."""
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    max_seq_len: int = 2048
    """Longest sequence the RoPE table is precomputed for; set it to the training seq_len."""
    depth_init: bool = True
    """Scale output-projection init by layer depth (see Transformer.init_weights)."""
    tie_embeddings: bool = False
    attn_type: str = "sdpa"
    """sdpa (F.scaled_dot_product_attention), flex (flex_attention with a BlockMask) or varlen
    (per-document attention: torch's flash varlen kernel on CUDA; needs block_causal)."""
    attn_mask_type: str = "causal"
    """causal (the whole window) or block_causal (each packed document attends only to itself)."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def validate(self) -> None:
        """Raise TitanError naming the first bad field; called by Transformer.__init__."""
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TitanError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_kv_heads is not None and (not isinstance(self.n_kv_heads, int) or self.n_kv_heads <= 0):
            raise TitanError(f"model.n_kv_heads must be a positive integer or None, got {self.n_kv_heads!r}")
        # A family whose args declare a head_dim field (qwen3) sets the width itself.
        if isinstance(getattr(type(self), "head_dim", None), property) and self.dim % self.n_heads != 0:
            raise TitanError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads != 0:
            raise TitanError(f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.kv_heads})")
        if self.head_dim % 2 != 0:
            # RoPE rotates pairs of features, so each head needs an even width.
            raise TitanError(f"model head_dim must be even for RoPE, got {self.head_dim}")
        if self.ffn_dim_multiplier is not None and self.ffn_dim_multiplier <= 0:
            raise TitanError(f"model.ffn_dim_multiplier must be > 0 or None, got {self.ffn_dim_multiplier!r}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise TitanError(
                f"model.norm_eps and model.rope_theta must be > 0, got {self.norm_eps!r} and {self.rope_theta!r}"
            )
        if self.use_rope_scaling and (
            self.rope_scale_factor <= 0
            or self.rope_high_freq_factor < self.rope_low_freq_factor
            or self.rope_low_freq_factor <= 0
            or self.rope_original_max_position_embeddings <= 0
        ):
            raise TitanError(
                "model rope scaling needs rope_scale_factor > 0, 0 < rope_low_freq_factor <= "
                "rope_high_freq_factor and rope_original_max_position_embeddings > 0"
            )
        if self.attn_type not in _ATTN_TYPES:
            raise TitanError(f"model.attn_type must be one of {', '.join(_ATTN_TYPES)}, got {self.attn_type!r}")
        if self.attn_mask_type not in _ATTN_MASK_TYPES:
            raise TitanError(
                f"model.attn_mask_type must be one of {', '.join(_ATTN_MASK_TYPES)}, got {self.attn_mask_type!r}"
            )
        if self.attn_type == "varlen" and self.attn_mask_type != "block_causal":
            raise TitanError('model.attn_type = "varlen" needs model.attn_mask_type = "block_causal"')


# Published Llama 3.1 shapes (Meta's params.json). The large flavors keep the 3.1 context
# length; the trainer should lower max_seq_len to its seq_len to keep the RoPE table small.
_LLAMA31: Mapping[str, Any] = MappingProxyType(
    dict(vocab_size=128256, rope_theta=500000.0, use_rope_scaling=True, max_seq_len=131072)
)

# The shipped flavors, read-only (more are added with titan.models.register_flavor). The args
# inside are shared: hand out copies (get_model_args, titan.models.get_flavor), never the entries.
llama3_configs: Mapping[str, TransformerModelArgs] = MappingProxyType(
    {
        # ~5.8M params: GQA (16 query / 8 kv heads) so the repeat-kv path is exercised in tests.
        "debugmodel": TransformerModelArgs(
            dim=256,
            n_layers=6,
            n_heads=16,
            n_kv_heads=8,
            vocab_size=2048,
            multiple_of=256,
            rope_theta=500000.0,
            max_seq_len=2048,
        ),
        "8B": TransformerModelArgs(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim_multiplier=1.3,
            multiple_of=1024,
            **_LLAMA31,
        ),
        "70B": TransformerModelArgs(
            dim=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            ffn_dim_multiplier=1.3,
            multiple_of=4096,
            **_LLAMA31,
        ),
        "405B": TransformerModelArgs(
            dim=16384,
            n_layers=126,
            n_heads=128,
            n_kv_heads=8,
            ffn_dim_multiplier=1.2,
            multiple_of=4096,
            **_LLAMA31,
        ),
    }
)


def get_model_args(flavor: str, **overrides) -> TransformerModelArgs:
    """A validated copy of a flavor with ``overrides`` applied."""
    if flavor not in llama3_configs:
        raise TitanError(f"model.flavor {flavor!r} is unknown; valid: {', '.join(llama3_configs)}")
    args = replace(llama3_configs[flavor], **overrides)
    args.validate()
    return args


def get_nparams_and_flops(model: nn.Module, seq_len: int) -> tuple[int, int]:
    """Total parameters and training FLOPs per token (forward + backward) of ``model``.

    FLOPs/token = 6 * N + 12 * L * H * Dh * T (Kaplan et al.; PaLM appendix B; torchtitan):
    each weight does one multiply-add (2 FLOPs) per token forward and twice that backward, and
    attention adds QK^T and AV, which have no weights (2 matmuls * 2 * 3 = 12 per layer, head
    and context position; the causal half is not discounted, as in those references).
    N excludes the token embedding because a lookup is a gather, not a matmul. If embeddings
    are tied the shared matrix is counted, since it does the output projection's matmul.

    Only what the module holds is counted, so a pipeline stage yields its own share
    (layers actually present). Works on meta-device models and on DTensor (FSDP/TP)
    parameters, whose numel() is the global size.
    """
    nparams = sum(p.numel() for p in model.parameters())
    emb = getattr(model, "tok_embeddings", None)
    out = getattr(model, "output", None)
    tied = emb is not None and out is not None and out.weight is emb.weight
    nparams_embedding = emb.weight.numel() if emb is not None and not tied else 0
    args: TransformerModelArgs = model.model_args  # type: ignore[assignment]
    n_layers = len(model.layers)  # type: ignore[arg-type]
    attn = 12 * n_layers * args.n_heads * args.head_dim * seq_len
    return nparams, 6 * (nparams - nparams_embedding) + attn
