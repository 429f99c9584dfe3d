"""gpt-oss's layers against references written plainly here: attention sinks (softmax over
[logits, sink], one query and head at a time), sliding windows (an explicit per-pair mask), the
flex path's sink rescaling, the clamped-SwiGLU experts with biases (a per-token loop), generation
with a KV cache, the flavors' shapes and the FLOP count of sliding-window layers and active experts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from titan.errors import TitanError
from titan.models import get_model_spec
from titan.models.gpt_oss.args import GptOssModelArgs, get_nparams_and_flops, gpt_oss_configs, gpt_oss_moe
from titan.models.gpt_oss.attention import dense_masks, flex_sink_attention, sink_attention
from titan.models.gpt_oss.model import GptOssTransformer
from titan.models.kv_cache import KVCache
from titan.models.moe import GroupedExperts, MoEArgs


def tiny(**kw) -> GptOssModelArgs:
    moe = dataclasses.replace(gpt_oss_moe(4), top_k=2, hidden_dim=24)
    base = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=64, max_seq_len=32)
    base.update(rope_factor=4.0, original_seq_len=8, sliding_window_size=3, moe_args=moe)
    base.update(kw)
    return GptOssModelArgs(**base)


def build(args: GptOssModelArgs, seed: int = 0) -> GptOssTransformer:
    torch.manual_seed(seed)
    model = GptOssTransformer(args)
    model.init_weights()
    with torch.no_grad():  # init leaves biases and sinks near zero: make them matter
        for name, p in model.named_parameters():
            if "sinks" in name or name.endswith(("bias", ".b1", ".b2", ".b3")):
                p.normal_(0, 0.5)
    return model


def plain_attention(q, k, v, sinks, allowed, scale):
    """One query and head at a time: softmax over [scores of the allowed keys, sink], sink dropped."""
    bs, n_heads, seqlen, _ = q.shape
    rep = n_heads // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(bs):
        for h in range(n_heads):
            for i in range(seqlen):
                keys = [j for j in range(k.shape[2]) if allowed(i, j)]
                logits = torch.stack([q[b, h, i] @ k[b, h // rep, j] * scale for j in keys] + [sinks[h]])
                p = torch.softmax(logits.double(), dim=0)[:-1]
                out[b, h, i] = sum(p[n] * v[b, h // rep, j].double() for n, j in enumerate(keys)).float()
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_sink_attention_is_softmax_over_logits_and_sink(window) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 7, 8, generator=g),
        torch.randn(2, 2, 7, 8, generator=g),
        torch.randn(2, 2, 7, 8, generator=g),
    )
    sinks = torch.randn(4, generator=g) * 2
    masks = dense_masks(7, window, torch.device("cpu"), None)
    mask = masks.full if window is None else masks.sliding
    out = sink_attention(q, k, v, sinks, mask, 8**-0.5)
    allowed = (lambda i, j: j <= i) if window is None else (lambda i, j: j <= i and i - j < window)
    torch.testing.assert_close(out, plain_attention(q, k, v, sinks, allowed, 8**-0.5), rtol=0, atol=1e-5)
    # A very negative sink takes no mass: plain causal softmax attention.
    plain = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask
    )
    torch.testing.assert_close(sink_attention(q, k, v, torch.full((4,), -1e4), mask, 8**-0.5), plain, atol=1e-5, rtol=0)


def test_sliding_window_mask_is_the_explicit_one_with_documents() -> None:
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
    masks = dense_masks(9, 3, torch.device("cpu"), doc_ids)
    explicit = torch.tensor(
        [[j <= i and i - j < 3 and doc_ids[0, i] == doc_ids[0, j] for j in range(9)] for i in range(9)]
    )
    assert torch.equal(masks.sliding[0], explicit)
    assert torch.equal(
        masks.full[0], torch.tensor([[j <= i and doc_ids[0, i] == doc_ids[0, j] for j in range(9)] for i in range(9)])
    )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_rescales_to_the_sink_softmax() -> None:
    """The CUDA kernel's identity out * sigmoid(lse - sink), checked with eager flex on CPU (forward),
    on all heads and on one TP rank's heads with their sinks."""
    from titan.models.gpt_oss.attention import block_masks

    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 4, 16, 8, generator=g),
        torch.randn(1, 2, 16, 8, generator=g),
        torch.randn(1, 2, 16, 8, generator=g),
    )
    sinks = torch.randn(4, generator=g)
    dense = dense_masks(16, 5, torch.device("cpu"), None)
    blocks = block_masks(16, 5, torch.device("cpu"), None)
    for d, b in ((dense.full, blocks.full), (dense.sliding, blocks.sliding)):
        want = sink_attention(q, k, v, sinks, d, 0.3)
        torch.testing.assert_close(flex_sink_attention(q, k, v, sinks, b, 0.3), want, atol=1e-5, rtol=0)
        # A TP 2 rank's share, as the TP plan leaves it: heads 2r, 2r + 1, kv head r, sinks 2r, 2r + 1.
        for r in range(2):
            qr, kr, vr, sr = q[:, 2 * r : 2 * r + 2], k[:, r : r + 1], v[:, r : r + 1], sinks[2 * r : 2 * r + 2]
            torch.testing.assert_close(sink_attention(qr, kr, vr, sr, d, 0.3), want[:, 2 * r : 2 * r + 2])
            local = flex_sink_attention(qr, kr, vr, sr, b, 0.3)
            torch.testing.assert_close(local, want[:, 2 * r : 2 * r + 2], atol=1e-5, rtol=0)


def test_clamped_swiglu_experts_with_biases_match_a_per_token_loop() -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(16, 12, 3, bias=True, swiglu_limit=0.5, swiglu_alpha=1.702)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.5)  # large enough that both clamps bite
    counts = torch.tensor([4, 0, 5])
    x = torch.randn(9, 16)

    def token(e: int, t: torch.Tensor) -> torch.Tensor:
        gate = experts.w1[e] @ t + experts.b1[e]
        up = experts.w3[e] @ t + experts.b3[e]
        gate, up = torch.clamp(gate, max=0.5), torch.clamp(up, -0.5, 0.5)
        return experts.w2[e] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + experts.b2[e]

    owner = [0] * 4 + [2] * 5
    want = torch.stack([token(e, t) for e, t in zip(owner, x)])
    assert (experts.w1[0] @ x[0] + experts.b1[0]).abs().max() > 0.5  # the clamp is exercised
    from titan.models.moe import run_grouped, run_loop

    b = (experts.b1, experts.b2, experts.b3)
    w = (experts.w1, experts.w2, experts.w3)
    for out in (
        experts(x, counts),
        run_loop(*w, x, counts, act=experts.act, biases=b),
        run_grouped(*w, x, counts, act=experts.act, biases=b),
        run_grouped(*w, x, counts, 8, act=experts.act, biases=b),  # padded groups (CUDA's alignment)
    ):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_generation_with_the_cache_matches_the_full_forward() -> None:
    args = tiny()
    model = build(args).eval()
    tokens = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(16)
        steps = [model(tokens[:, :6], kv_cache=cache)]
        cache.pos += 6
        for i in range(6, 10):
            steps.append(model(tokens[:, i : i + 1], kv_cache=cache))
            cache.pos += 1
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_flavors_by_name_and_shape() -> None:
    spec = get_model_spec("gpt_oss")
    assert list(spec.flavors) == ["debugmodel", "20b", "120b"]
    totals = {}
    for name, args in gpt_oss_configs.items():
        with torch.device("meta"):
            model = GptOssTransformer(dataclasses.replace(args, max_seq_len=8))
        totals[name] = get_nparams_and_flops(model, 8)[0]
    # The release's sizes: 20.9B and 116.8B parameters.
    assert round(totals["20b"] / 1e9, 1) == 20.9 and round(totals["120b"] / 1e9, 1) == 116.8, totals
    d = gpt_oss_configs["debugmodel"]
    assert (d.dim, d.n_layers, d.n_heads, d.kv_heads, d.head_dim, d.moe_args.num_experts) == (256, 4, 64, 8, 64, 8)


def test_flops_count_sliding_windows_and_active_experts_by_hand() -> None:
    args = tiny(n_layers=4, sliding_window_size=5)
    with torch.device("meta"):
        model = GptOssTransformer(args)
    seq = 20
    dim, h, kvh, hd, hidden, e, k = 32, 4, 2, 8, 24, 4, 2
    attn_params = dim * h * hd + h * hd + 2 * (dim * kvh * hd + kvh * hd) + h * hd * dim + dim + h
    router = dim * e + e
    expert = 3 * dim * hidden + 2 * hidden + dim
    dense = 4 * (attn_params + router + 2 * dim) + dim + 64 * dim  # blocks, final norm, output
    total = dense + 64 * dim + 4 * e * expert
    active = 6 * (dense + 4 * k * expert)
    attn = 12 * h * hd * (5 + seq + 5 + seq)  # layers 0 and 2 slide over 5 keys
    assert get_nparams_and_flops(model, seq) == (total, active + attn)


def test_bad_settings_are_refused_in_one_line() -> None:
    for kw, match in (
        (dict(head_dim=7), "model.head_dim must be a positive even"),
        (dict(sliding_window_size=0), "model.sliding_window_size"),
        (dict(layer_types=["full_attention"]), "model.layer_types must list 3"),
        (dict(rope_type="ntk"), "model.rope_type"),
        (dict(attn_type="varlen", attn_mask_type="block_causal"), "not supported by gpt_oss"),
        (dict(moe_args=MoEArgs(num_experts=4, hidden_dim=8)), "num_shared_experts must be 0"),
    ):
        with pytest.raises(TitanError, match=match):
            tiny(**kw).validate()


def test_layouts_that_cannot_split_are_refused_in_one_line() -> None:
    tiny().check_parallelism(2, 1)  # whole heads, kv heads and expert widths per rank
    moe = dataclasses.replace(gpt_oss_moe(4), top_k=2, hidden_dim=26)
    for args, tp, cp, match in (
        (tiny(), 4, 1, r"tensor_parallel_degree = 4 must divide model.n_kv_heads \(2\)"),
        (tiny(n_kv_heads=4, moe_args=moe), 4, 1, r"must divide model.moe_args.hidden_dim \(26\)"),
        (tiny(), 1, 2, "context_parallel_degree = 2 is not supported"),
    ):
        with pytest.raises(TitanError, match=match):
            args.check_parallelism(tp, cp)


def test_trains_on_cpu_and_the_loss_falls() -> None:
    args = tiny()
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(12):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for n, p in model.named_parameters()), "every parameter gets a gradient"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5 and math.isfinite(losses[-1]), losses


def test_memory_estimate_equals_the_real_peak(monkeypatch) -> None:
    """The estimate's fake forward/backward allocates what the real one does: the sink attention's
    scores of every layer, the routed experts' activations, all experts stored."""
    import titan.models
    from titan.config import load_config
    from titan.models import register_flavor
    from titan.training.loss import cross_entropy_sum
    from titan.training.memory import LiveBytes, estimate_memory

    args = tiny(vocab_size=2048)
    specs = titan.models._REGISTRY.specs()
    monkeypatch.setitem(specs, "gpt_oss", specs["gpt_oss"])  # restored at teardown
    register_flavor("gpt_oss", "tiny", args, replace=True)
    flags = ["--model.name", "gpt_oss", "--model.flavor", "tiny", "--training.seq_len", "32"]
    cfg = load_config([*flags, "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32"])
    estimate = estimate_memory(cfg, 1)
    model = build(dataclasses.replace(args, max_seq_len=32))
    assert estimate.params == sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, args.vocab_size, (4, 33))
    tracker = LiveBytes()
    tracker.ignore([*model.parameters(), *model.buffers(), tokens])
    with tracker:
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert estimate.activation_bytes == pytest.approx(tracker.peak, rel=1e-3)
