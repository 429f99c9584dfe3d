"""DeepSeek-V3 hyper-parameters (torchtitan's deepseek_v3 family): multi-head latent attention,
YaRN RoPE on the rotary part of each head, ``n_dense_layers`` dense blocks and then MoE blocks with
routed + shared experts; torchtitan v0.2.2's flavors by name and shape; parameter / FLOP counts."""

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
from titan.models.rope import YarnScaling, yarn_mscale


@dataclass
class DeepSeekV3ModelArgs(TransformerModelArgs):
    vocab_size: int = 102400
    dim: int = 2048
    n_layers: int = 27
    n_heads: int = 16
    rope_theta: float = 10000.0
    max_seq_len: int = 16384
    inter_dim: int = 10944
    """Hidden width of the dense blocks' SwiGLU."""
    moe_inter_dim: int = 1408
    """Hidden width of each routed expert (a shared expert is num_shared_experts times wider)."""
    n_dense_layers: int = 1
    """Blocks 0 .. n_dense_layers - 1 are dense, the rest MoE."""
    moe_args: MoEArgs = field(default_factory=lambda: MoEArgs(score_before_experts=False))
    q_lora_rank: int = 0
    """Rank of the query's low-rank projection (wq_a -> q_norm -> wq_b); 0: one full wq."""
    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (wkv_a -> kv_norm -> wkv_b)."""
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    """Per-head query/key features that carry RoPE; the key's are shared by all heads."""
    v_head_dim: int = 128
    latent_norm_eps: float | None = None
    """eps of q_norm and kv_norm; None: norm_eps (torchtitan). Hugging Face uses 1e-6 there."""
    # YaRN (torchtitan's names)
    original_seq_len: int = 4096
    rope_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    """With YaRN on, the softmax scale is multiplied by (0.1 * mscale * ln(rope_factor) + 1)^2
    (Hugging Face's mscale_all_dim; 0: no change)."""
    use_yarn: bool | None = None
    """None: YaRN when max_seq_len > original_seq_len (torchtitan's rule); True/False: always/never
    (Hugging Face configs say which)."""
    rope_attention_factor: float = 1.0
    """Scale of the rotary table (so of the rotary part of q.k by its square) under YaRN; 1 in
    torchtitan, Hugging Face's yarn ``attention_factor``."""
    mtp_depth: int = 0
    """Multi-token-prediction depths (titan.models.mtp; config key model.mtp_depth): each adds one MoE
    block (layer n_layers + k, the release's layer 61) and its fusion parts. 0: none."""

    def __post_init__(self) -> None:
        if isinstance(self.moe_args, dict):  # read back from model_args.json
            self.moe_args = MoEArgs(**self.moe_args)

    @property
    def head_dim(self) -> int:  # type: ignore[override]
        """The rotary width: the RoPE table's pair count is half of it."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_enabled(self) -> bool:
        return self.max_seq_len > self.original_seq_len if self.use_yarn is None else self.use_yarn

    def yarn(self) -> YarnScaling | None:
        if not self.yarn_enabled:
            return None
        return YarnScaling(
            factor=self.rope_factor,
            original_max_position_embeddings=self.original_seq_len,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            attention_factor=self.rope_attention_factor,
        )

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.yarn_enabled:
            scale *= yarn_mscale(self.rope_factor, self.mscale) ** 2
        return scale

    def validate(self) -> None:
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "vocab_size",
            "max_seq_len",
            "inter_dim",
            "moe_inter_dim",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "original_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TitanError(f"model.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise TitanError(f"model.mtp_depth must be an integer >= 0, got {self.mtp_depth!r}")
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise TitanError(f"model.qk_rope_head_dim must be a positive even integer, got {self.qk_rope_head_dim!r}")
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise TitanError(f"model.q_lora_rank must be an integer >= 0 (0: a plain wq), got {self.q_lora_rank!r}")
        if not isinstance(self.n_dense_layers, int) or not 0 <= self.n_dense_layers <= self.n_layers:
            raise TitanError(
                f"model.n_dense_layers must be from 0 to n_layers ({self.n_layers}), got {self.n_dense_layers!r}"
            )
        for name in ("norm_eps", "rope_theta", "rope_factor", "rope_attention_factor"):
            if getattr(self, name) <= 0:
                raise TitanError(f"model.{name} must be > 0, got {getattr(self, name)!r}")
        if self.latent_norm_eps is not None and self.latent_norm_eps <= 0:
            raise TitanError(f"model.latent_norm_eps must be > 0 or None, got {self.latent_norm_eps!r}")
        if self.n_kv_heads not in (None, self.n_heads):
            raise TitanError("model.n_kv_heads must be None for deepseek_v3 (latent attention gives every head k/v)")
        if self.use_rope_scaling:
            raise TitanError("model.use_rope_scaling (Llama 3.1 scaling) is not deepseek_v3's: it uses YaRN (use_yarn)")
        if self.attn_type == "varlen":
            raise TitanError('model.attn_type = "varlen" is not supported by deepseek_v3; valid: sdpa, flex')
        self.moe_args.validate()
        # The rest (attention/mask types) as llama's, on a stand-in whose head shape passes its checks.
        TransformerModelArgs(n_heads=1, dim=2, attn_type=self.attn_type, attn_mask_type=self.attn_mask_type).validate()

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers


def _moe(num_experts: int, shared: int, top_k: int, **kw: Any) -> MoEArgs:
    kw.setdefault("score_func", "softmax")
    return MoEArgs(
        num_experts=num_experts, num_shared_experts=shared, top_k=top_k, route_norm=kw.pop("route_norm", False),
        score_before_experts=False, **kw,
    )  # fmt: skip


_MLA: dict[str, Any] = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_FLEX: dict[str, Any] = dict(attn_type="flex", attn_mask_type="block_causal")


def _debug(**kw: Any) -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        vocab_size=2048, dim=256, inter_dim=1024, moe_inter_dim=256, n_layers=6, n_dense_layers=1, n_heads=16,
        moe_args=_moe(8, 2, 3), q_lora_rank=0, mscale=0.70, **_MLA, **kw,
    )  # fmt: skip


# torchtitan v0.2.2's deepseek_v3 flavors by name and shape (read-only; titan.models.register_flavor adds).
deepseek_v3_configs: Mapping[str, DeepSeekV3ModelArgs] = MappingProxyType(
    {
        "debugmodel": _debug(),
        "debugmodel_flex_attn": _debug(**_FLEX),
        "16B": DeepSeekV3ModelArgs(
            vocab_size=102400,
            dim=2048,
            inter_dim=10944,
            moe_inter_dim=1408,
            n_layers=27,
            n_dense_layers=1,
            n_heads=16,
            moe_args=_moe(64, 2, 6),
            q_lora_rank=0,
            mscale=0.70,
            **_MLA,
            **_FLEX,
        ),
        "236B": DeepSeekV3ModelArgs(
            vocab_size=102400,
            dim=5120,
            inter_dim=12288,
            moe_inter_dim=1536,
            n_layers=60,
            n_dense_layers=1,
            n_heads=128,
            moe_args=_moe(160, 2, 6, num_expert_groups=8, num_limited_groups=3, route_scale=16.0),
            q_lora_rank=1536,
            **_MLA,
            **_FLEX,
        ),
        "671B": DeepSeekV3ModelArgs(
            vocab_size=129280,
            dim=7168,
            inter_dim=18432,
            moe_inter_dim=2048,
            n_layers=61,
            n_dense_layers=3,
            n_heads=128,
            moe_args=_moe(
                256,
                1,
                8,
                num_expert_groups=8,
                num_limited_groups=4,
                score_func="sigmoid",
                route_norm=True,
                route_scale=2.5,
            ),
            q_lora_rank=1536,
            **_MLA,
            **_FLEX,
        ),
        # Moonshot's Kimi K2 (model_type kimi_k2 in config.json, DeepseekV3ForCausalLM): 384 experts in
        # one group, one dense block, 64 heads, YaRN x32 on theta 50000, its 163840-token vocabulary.
        "kimi_k2": DeepSeekV3ModelArgs(
            vocab_size=163840,
            dim=7168,
            inter_dim=18432,
            moe_inter_dim=2048,
            n_layers=61,
            n_dense_layers=1,
            n_heads=64,
            q_lora_rank=1536,
            norm_eps=1e-6,
            latent_norm_eps=1e-6,
            rope_theta=50000.0,
            max_seq_len=131072,
            original_seq_len=4096,
            rope_factor=32.0,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            use_yarn=True,
            moe_args=_moe(384, 1, 8, score_func="sigmoid", route_norm=True, route_scale=2.827),
            **_MLA,
            **_FLEX,
        ),
    }  # fmt: skip
)


def get_nparams_and_flops(model: nn.Module, seq_len: int) -> tuple[int, int]:
    """All parameters and training FLOPs per token on the ACTIVE parameters: 6 * (dense
    non-embedding, the latent attention's projections included, + router + shared experts + routed
    experts * top_k / num_experts) + 6 * L * H * (qk_head_dim + v_head_dim) * T (q.k over the
    query-key width, the weighted sum over the value width; torchtitan's count)."""
    args: DeepSeekV3ModelArgs = model.model_args  # type: ignore[assignment]
    n_layers = len(model.layers)  # type: ignore[arg-type]
    attn = 6 * n_layers * args.n_heads * (args.qk_head_dim + args.v_head_dim) * seq_len
    return sum(p.numel() for p in model.parameters()), 6 * active_matmul_params(model) + attn


__all__ = ["DeepSeekV3ModelArgs", "deepseek_v3_configs", "get_nparams_and_flops"]
