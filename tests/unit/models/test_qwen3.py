"""qwen3's flavors (torchtitan v0.2.2's names and shapes), their parameter counts (the published
sizes of Qwen3's releases), FLOPs on the active experts, and the head width of its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from titan.errors import TitanError
from titan.models import get_model_spec
from titan.models.qwen3 import Qwen3ModelArgs, Qwen3Transformer, get_nparams_and_flops, qwen3_configs

# torchtitan v0.2.2 torchtitan/models/qwen3/__init__.py: dim, layers, heads, kv heads, hidden_dim,
# tied, experts, experts' width, rope_theta, max_seq_len (vocab 151936, debug 2048; head_dim 128).
SHAPES = {
    "debugmodel": (256, 8, 16, 8, 3072, True, 0, 0, 1e6, 4096),
    "0.6B": (1024, 28, 16, 8, 3072, True, 0, 0, 1e6, 4096),
    "1.7B": (2048, 28, 16, 8, 6144, True, 0, 0, 1e6, 4096),
    "4B": (2560, 36, 32, 8, 9728, True, 0, 0, 1e6, 4096),
    "8B": (4096, 36, 32, 8, 12288, False, 0, 0, 1e6, 4096),
    "14B": (5120, 40, 40, 8, 17408, False, 0, 0, 1e6, 4096),
    "32B": (5120, 64, 64, 8, 25600, False, 0, 0, 1e6, 4096),
    "debugmodel_moe": (256, 8, 16, 8, 3072, False, 64, 768, 1e6, 4096),
    "30B-A3B": (2048, 48, 32, 4, 6144, False, 128, 768, 1e6, 262144),
    "235B-A22B": (4096, 94, 64, 4, 12288, False, 128, 1536, 5e6, 4096),
}
# Hugging Face's model cards' totals (transformers' own count of Qwen/Qwen3-*), and what titan counts.
PARAMS = {
    "0.6B": 596_049_920,
    "1.7B": 1_720_574_976,
    "4B": 4_022_468_096,
    "8B": 8_190_735_360,
    "14B": 14_768_307_200,
    "32B": 32_762_123_264,
    "30B-A3B": 30_532_122_624,
    "235B-A22B": 235_093_634_560,
}


def _meta(args: Qwen3ModelArgs) -> Qwen3Transformer:
    with torch.device("meta"):
        return Qwen3Transformer(replace(args, max_seq_len=16))


def test_flavors_are_torchtitans_by_name_and_shape() -> None:
    assert list(qwen3_configs) == list(SHAPES)
    assert get_model_spec("qwen3").flavors.keys() == qwen3_configs.keys()
    for name, (dim, layers, heads, kv, hidden, tied, experts, width, theta, max_seq) in SHAPES.items():
        a = qwen3_configs[name]
        got = (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.hidden_dim, a.tie_embeddings, a.rope_theta, a.max_seq_len)
        assert got == (dim, layers, heads, kv, hidden, tied, theta, max_seq), name
        assert a.head_dim == 128 and a.vocab_size == (2048 if "debug" in name else 151936)
        assert a.moe_enabled == bool(experts)
        if experts:
            m = a.moe_args
            assert (m.num_experts, m.hidden_dim, m.top_k, m.num_shared_experts) == (experts, width, 8, 0)
            assert (m.score_func, m.route_norm, m.route_scale, m.score_before_experts) == ("softmax", True, 1.0, False)
            assert all(a.is_moe_layer(i) for i in range(layers))


def test_parameter_counts_and_flops_on_the_active_experts() -> None:
    for name, total in PARAMS.items():
        assert get_nparams_and_flops(_meta(qwen3_configs[name]), 4096)[0] == total, name
    args = qwen3_configs["30B-A3B"]
    model = _meta(args)
    n, flops = get_nparams_and_flops(model, 4096)
    emb = args.vocab_size * args.dim
    experts = sum(p.numel() for k, p in model.named_parameters() if ".moe.experts." in k)
    active = n - emb - experts + experts * 8 // 128  # untied: the embedding is a lookup, not a matmul
    assert flops == 6 * active + 12 * 48 * 32 * 128 * 4096
    # About 3.3B active with the embedding, as Qwen3-30B-A3B's model card says.
    assert 3.3e9 < active + emb < 3.4e9


def test_head_width_is_its_own_and_q_k_norms_are_per_head() -> None:
    args = Qwen3ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=12, hidden_dim=40, vocab_size=64)
    model = Qwen3Transformer(args)
    attn = model.layers["0"].attention  # type: ignore[union-attr]
    assert attn.wq.weight.shape == (48, 32) and attn.wk.weight.shape == (24, 32) and attn.wo.weight.shape == (32, 48)
    assert attn.q_norm.weight.shape == (12,) and attn.k_norm.weight.shape == (12,)
    model.init_weights()
    assert model(torch.randint(0, 64, (1, 8))).shape == (1, 8, 64)
    with pytest.raises(TitanError, match="model head_dim must be even for RoPE"):
        Qwen3Transformer(replace(args, head_dim=11))
    with pytest.raises(TitanError, match="ffn_dim_multiplier does not apply to qwen3"):
        Qwen3Transformer(replace(args, ffn_dim_multiplier=1.3))
    with pytest.raises(TitanError, match=r"mlp_only_layers \[3\] are not layers of a 1-layer model"):
        Qwen3Transformer(replace(args, moe_enabled=True, mlp_only_layers=[3]))
