"""deepseek_v3's layers against references written plainly here: latent attention against explicit
per-head attention (YaRN table and softmax scale included), group-limited routing against a
per-token loop; torchtitan v0.2.2's flavors by name and shape; FLOPs against a hand count."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from titan.errors import TitanError
from titan.models import get_model_spec
from titan.models.deepseek_v3.args import DeepSeekV3ModelArgs, deepseek_v3_configs, get_nparams_and_flops
from titan.models.deepseek_v3.model import DeepSeekV3Transformer, MLAttention, precompute_freqs_cis
from titan.models.moe import MoEArgs, TokenChoiceTopKRouter
from titan.models.rope import yarn_inv_freq, yarn_mscale

MLA = dict(dim=32, n_heads=3, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, max_seq_len=40)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _reference_mla(att: MLAttention, args: DeepSeekV3ModelArgs, x: torch.Tensor) -> torch.Tensor:
    """Per head, per position: rotate interleaved pairs (2j, 2j+1) by pos * inv_freq[j], causal softmax."""
    bs, seqlen, _ = x.shape
    nope, rope, vd, h_n = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim, args.n_heads
    if args.q_lora_rank:
        q = _rms(x @ att.wq_a.weight.T, att.q_norm.weight, args.norm_eps) @ att.wq_b.weight.T
    else:
        q = x @ att.wq.weight.T
    kv_a = x @ att.wkv_a.weight.T
    latent, k_rope = kv_a[..., : args.kv_lora_rank], kv_a[..., args.kv_lora_rank :]
    kv = _rms(latent, att.kv_norm.weight, args.norm_eps) @ att.wkv_b.weight.T
    yarn = args.yarn()
    assert yarn is not None
    inv_freq, magnitude = yarn_inv_freq(rope, args.rope_theta, yarn), args.rope_attention_factor
    scale = (nope + rope) ** -0.5 * yarn_mscale(args.rope_factor, args.mscale) ** 2

    def rotate(v: torch.Tensor, pos: int) -> torch.Tensor:
        out = v.clone()
        for j in range(rope // 2):
            c, s = math.cos(pos * inv_freq[j].item()), math.sin(pos * inv_freq[j].item())
            a, b = v[2 * j], v[2 * j + 1]
            out[2 * j], out[2 * j + 1] = magnitude * (a * c - b * s), magnitude * (a * s + b * c)
        return out

    heads = []
    for h in range(h_n):
        q_h = q[..., h * (nope + rope) : (h + 1) * (nope + rope)]
        kv_h = kv[..., h * (nope + vd) : (h + 1) * (nope + vd)]
        out = torch.zeros(bs, seqlen, vd)
        for b in range(bs):
            qs = [torch.cat([q_h[b, i, :nope], rotate(q_h[b, i, nope:], i)]) for i in range(seqlen)]
            ks = [torch.cat([kv_h[b, j, :nope], rotate(k_rope[b, j], j)]) for j in range(seqlen)]
            for i in range(seqlen):
                logits = torch.stack([qs[i] @ ks[j] * scale for j in range(i + 1)])
                out[b, i] = torch.softmax(logits, 0) @ kv_h[b, : i + 1, nope:]
        heads.append(out)
    return torch.cat(heads, -1) @ att.wo.weight.T


@pytest.mark.parametrize("q_lora_rank", [0, 10])
def test_latent_attention_matches_explicit_per_head_attention(q_lora_rank):
    args = DeepSeekV3ModelArgs(
        **MLA, q_lora_rank=q_lora_rank, use_yarn=True, original_seq_len=8, rope_factor=4.0, mscale=0.7,
        rope_attention_factor=1.2, norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    att = MLAttention(args)
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    x = torch.randn(2, 7, args.dim)
    freqs = precompute_freqs_cis(args)
    with torch.no_grad():
        torch.testing.assert_close(att(x, freqs), _reference_mla(att, args, x), atol=1e-5, rtol=1e-5)


def _reference_route(scores, bias, groups, limited, top_k):
    """Per token: groups ranked by the sum of their two best biased scores, the best ``limited`` kept,
    then the top_k biased scores among their experts; weights the unbiased scores."""
    n, e = scores.shape
    per = e // groups
    chosen = []
    for t in range(n):
        biased = (scores[t] + bias).tolist()
        group_score = [sum(sorted(biased[g * per : (g + 1) * per])[-2:]) for g in range(groups)]
        keep = sorted(range(groups), key=lambda g: -group_score[g])[:limited]
        candidates = [i for g in keep for i in range(g * per, (g + 1) * per)]
        chosen.append(sorted(sorted(candidates, key=lambda i: -biased[i])[:top_k]))
    return chosen


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_group_limited_routing_matches_a_per_token_loop(score_func):
    torch.manual_seed(0)
    router = TokenChoiceTopKRouter(
        16, 12, 3, score_func, route_norm=True, route_scale=2.0, num_expert_groups=4, num_limited_groups=2
    )
    x, bias = torch.randn(40, 16), torch.randn(12) * 0.05
    top, experts, counts, scores = router(x, bias)
    want = _reference_route(scores, bias, 4, 2, 3)
    got = [sorted(row) for row in experts.tolist()]
    assert got == want
    for t, row in enumerate(experts.tolist()):
        w = scores[t, row]
        torch.testing.assert_close(top[t], w / w.sum() * 2.0)
    assert counts.tolist() == [sum(r.count(i) for r in want) for i in range(12)]
    # The limit binds: some token's unlimited top-3 reaches outside its two groups.
    free = torch.topk(scores + bias, 3).indices.sort().values.tolist()
    assert free != want


def test_group_arguments_are_checked_in_one_line():
    with pytest.raises(TitanError, match="num_expert_groups"):
        MoEArgs(num_experts=8, top_k=2, num_expert_groups=3, num_limited_groups=1).validate()
    with pytest.raises(TitanError, match="num_limited_groups"):
        MoEArgs(num_experts=8, top_k=4, num_expert_groups=4, num_limited_groups=1).validate()


# torchtitan v0.2.2 deepseek_v3/__init__.py, by name and shape.
TORCHTITAN = {
    "debugmodel": (2048, 256, 1024, 256, 6, 1, 16, 8, 2, 3, None, None, "softmax", False, 1.0, 0, 0.70, "sdpa"),
    "debugmodel_flex_attn": (
        2048, 256, 1024, 256, 6, 1, 16, 8, 2, 3, None, None, "softmax", False, 1.0, 0, 0.70, "flex"
    ),
    "16B": (102400, 2048, 10944, 1408, 27, 1, 16, 64, 2, 6, None, None, "softmax", False, 1.0, 0, 0.70, "flex"),
    "236B": (102400, 5120, 12288, 1536, 60, 1, 128, 160, 2, 6, 8, 3, "softmax", False, 16.0, 1536, 1.0, "flex"),
    "671B": (129280, 7168, 18432, 2048, 61, 3, 128, 256, 1, 8, 8, 4, "sigmoid", True, 2.5, 1536, 1.0, "flex"),
}  # fmt: skip


def test_flavors_are_torchtitans_by_name_and_shape():
    assert list(get_model_spec("deepseek_v3").flavors) == [*TORCHTITAN, "kimi_k2"]  # tests/unit/models/test_kimi_k2.py
    for name, want in TORCHTITAN.items():
        a = deepseek_v3_configs[name]
        m = a.moe_args
        got = (
            a.vocab_size, a.dim, a.inter_dim, a.moe_inter_dim, a.n_layers, a.n_dense_layers, a.n_heads, m.num_experts,
            m.num_shared_experts, m.top_k, m.num_expert_groups, m.num_limited_groups, m.score_func, m.route_norm,
            m.route_scale, a.q_lora_rank, a.mscale, a.attn_type,
        )  # fmt: skip
        assert got == want, name
        assert (a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (512, 128, 64, 128)
        assert not m.score_before_experts and a.max_seq_len == 16384 and a.original_seq_len == 4096
        assert (a.rope_factor, a.beta_fast, a.beta_slow, a.rope_theta) == (40.0, 32.0, 1.0, 10000.0)
    with torch.device("meta"):
        big = DeepSeekV3Transformer(dataclasses.replace(deepseek_v3_configs["671B"], max_seq_len=8))
    assert sum(p.numel() for p in big.parameters()) == 671_026_404_352  # DeepSeek-V3's 671B (MTP aside)


def test_flops_count_latent_attention_and_active_experts_by_hand():
    args = dataclasses.replace(deepseek_v3_configs["debugmodel"], max_seq_len=64)
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    attention = 256 * 16 * 192 + 256 * (512 + 64) + 512 + 512 * 16 * 256 + 16 * 128 * 256 + 2 * 256
    dense_ffn = 3 * 256 * 1024
    routed = 8 * 3 * 256 * 256
    moe_other = 256 * 8 + 3 * 256 * 512  # router, two shared experts as one 512-wide SwiGLU
    head = 256 + 256 * 2048  # final norm, output
    total = 2048 * 256 + 6 * attention + dense_ffn + 5 * (routed + moe_other) + head
    active = 6 * attention + dense_ffn + 5 * (routed * 3 // 8 + moe_other) + head
    nparams, flops = get_nparams_and_flops(model, 2048)
    assert nparams == total
    assert flops == 6 * active + 6 * 6 * 16 * (192 + 128) * 2048


def test_yarn_follows_torchtitans_rule_and_scales_softmax():
    args = DeepSeekV3ModelArgs(**{**MLA, "max_seq_len": 4096})
    assert not args.yarn_enabled and args.softmax_scale == 10**-0.5
    long = dataclasses.replace(args, max_seq_len=4097, mscale=0.7)
    assert long.yarn_enabled
    assert long.softmax_scale == pytest.approx(10**-0.5 * (0.1 * 0.7 * math.log(40) + 1) ** 2)


def test_kv_cache_decoding_matches_full_recompute():
    """The cache keeps keys (qk_head_dim) and values (v_head_dim) at their own widths."""
    from titan.models.kv_cache import KVCache

    args = DeepSeekV3ModelArgs(
        **{**MLA, "max_seq_len": 16}, vocab_size=64, n_layers=2, n_dense_layers=1, inter_dim=32, moe_inter_dim=16,
        moe_args=MoEArgs(num_experts=4, top_k=2, score_before_experts=False), use_yarn=True, original_seq_len=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, 64, (2, 12))
    cache = KVCache(16)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :8], kv_cache=cache)]
        cache.advance(8)
        for i in range(8, 12):
            steps.append(model(tokens[:, i : i + 1], kv_cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_memory_estimate_stores_every_expert_and_measures_latent_attention(monkeypatch):
    """Static memory: every parameter (all experts, the latent projections) by hand; the fake-tensor
    forward/backward peak equals the real one's."""
    import titan.models
    from titan.config import load_config
    from titan.models import register_flavor
    from titan.training.loss import cross_entropy_sum
    from titan.training.memory import LiveBytes, estimate_memory

    args = DeepSeekV3ModelArgs(
        **{**MLA, "max_seq_len": 32}, vocab_size=2048, n_layers=2, n_dense_layers=1, inter_dim=32, moe_inter_dim=16,
        q_lora_rank=8, moe_args=MoEArgs(num_experts=4, top_k=2, score_before_experts=False),
    )  # fmt: skip
    specs = titan.models._REGISTRY.specs()
    monkeypatch.setitem(specs, "deepseek_v3", specs["deepseek_v3"])  # restored at teardown
    register_flavor("deepseek_v3", "memtest", args, replace=True)
    config = load_config(
        ["--model.name", "deepseek_v3", "--model.flavor", "memtest", "--training.seq_len", "32"]
        + ["--training.local_batch_size", "2", "--training.mixed_precision_param", "float32"]
    )
    # Per block wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo, two norms; the dense FFN; router, 4 experts,
    # the shared one; the vocabulary rows are the shipped tokenizer's 2048.
    attention = 32 * 8 + 8 + 8 * 3 * 10 + 32 * (12 + 4) + 12 + 12 * 3 * (6 + 5) + 3 * 5 * 32 + 2 * 32
    stored = 2048 * 32 + 2 * attention + 3 * 32 * 32 + (32 * 4 + 4 * 3 * 32 * 16 + 3 * 32 * 16) + 32 + 32 * 2048
    assert estimate_memory(config, 1).params == stored
    est = estimate_memory(config, 1).activation_bytes
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(dataclasses.replace(args))
    model.init_weights()
    tokens = torch.randint(0, 2048, (2, 33))
    tracker = LiveBytes()
    tracker.ignore([*model.parameters(), *model.buffers(), tokens])
    with tracker:
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    # The estimate counts what a GPU's attention kernel saves (memory-efficient: output and
    # log-sum-exp); the CPU takes the math path for latent attention's narrower values and also
    # keeps the scores and their softmax (2% here).
    assert 0 < tracker.peak - est < 0.03 * tracker.peak


def test_the_model_keeps_the_yarn_choice_it_was_built_with():
    """A run builds with max_seq_len = its seq_len; an export raises max_seq_len to the context length,
    which must not turn YaRN on for weights trained without it."""
    from titan.checkpointing.hf import export_args, model_args_of

    flavor = deepseek_v3_configs["671B"]
    with torch.device("meta"):
        model = DeepSeekV3Transformer(dataclasses.replace(flavor, max_seq_len=4096, n_layers=4))
    args = export_args(model_args_of(model), {"model": {"name": "deepseek_v3", "flavor": "671B"}})
    assert args.max_seq_len == 16384 and args.use_yarn is False and not args.yarn_enabled
    assert flavor.use_yarn is None  # the flavor table is untouched
