from __future__ import annotations

import copy
import math
import pathlib
import re
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import titan.models.llama.model as llama_model
from tests.helpers import tiny
from titan.errors import TitanError
from titan.models.llama import (
    Transformer,
    TransformerModelArgs,
    get_model_args,
    get_nparams_and_flops,
    llama3_configs,
)
from titan.models.llama.flex import causal_block_mask
from titan.models.llama.model import Attention, precompute_freqs_cis

# The shared tiny model (well under a second per test on 2 CPU cores), with room for 64 positions.
TINY = replace(tiny.TINY, max_seq_len=64)


def build(args: TransformerModelArgs = TINY, seed: int = 0) -> Transformer:
    return tiny.build(args, seed)


@pytest.mark.parametrize("flavor,expected", [("8B", 8.03e9), ("70B", 70.55e9), ("405B", 405.85e9)])
def test_published_param_counts_on_meta(flavor: str, expected: float) -> None:
    with torch.device("meta"):
        model = Transformer(llama3_configs[flavor])
    assert all(p.is_meta for p in model.parameters())
    nparams, flops = get_nparams_and_flops(model, seq_len=8192)
    assert abs(nparams - expected) / expected < 0.005
    args = llama3_configs[flavor]
    emb = args.vocab_size * args.dim
    attn = 12 * args.n_layers * args.n_heads * args.head_dim * 8192
    assert flops == 6 * (nparams - emb) + attn


def test_debugmodel_forward_shape_and_size() -> None:
    args = llama3_configs["debugmodel"]
    assert args.kv_heads < args.n_heads  # GQA is exercised
    model = build(args)
    nparams, flops = get_nparams_and_flops(model, seq_len=256)
    assert 5e6 < nparams < 7e6
    assert flops == 6 * (nparams - args.vocab_size * args.dim) + 12 * 6 * 256 * 256
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, args.vocab_size)
    assert torch.isfinite(logits).all()
    # output init (std dim**-0.5 on unit-RMS hidden states) gives O(1) logits
    assert 0.5 < logits.std().item() < 2.0


def test_state_dict_keys_follow_meta_layout() -> None:
    keys = set(build().state_dict())
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(TINY.n_layers):
        p = f"layers.{i}."
        expected |= {p + f"attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {p + f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        expected |= {p + "attention_norm.weight", p + "ffn_norm.weight"}
    assert keys == expected  # freqs_cis is a non-persistent buffer


def test_init_deterministic_and_seed_dependent() -> None:
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert not torch.equal(sa["layers.0.attention.wq.weight"], sc["layers.0.attention.wq.weight"])
    # freqs_cis is rebuilt by init_weights after to_empty left garbage in it
    assert torch.equal(a.freqs_cis, precompute_freqs_cis(TINY))


def test_init_stds_and_depth_scaling() -> None:
    args = replace(TINY, dim=256, n_heads=8, n_kv_heads=4, n_layers=4, vocab_size=512)
    model = build(args)
    wq = model.layers["0"].attention.wq.weight
    assert abs(wq.std().item() - 0.02) < 0.002
    for i in range(4):
        wo = model.layers[str(i)].attention.wo.weight
        assert abs(wo.std().item() / (0.02 / math.sqrt(2 * (i + 1))) - 1) < 0.1
    out = model.output.weight
    assert out.abs().max().item() <= 3 * 256**-0.5 + 1e-6  # truncated at 3 std
    assert torch.equal(model.norm.weight, torch.ones(256))
    flat = build(replace(args, depth_init=False))
    for i in range(4):
        wo = flat.layers[str(i)].attention.wo.weight
        assert abs(wo.std().item() / (0.02 / math.sqrt(2 * 4)) - 1) < 0.1


def test_causal() -> None:
    model = build()
    tokens = torch.randint(0, TINY.vocab_size, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def naive_attention(attn: Attention, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Textbook GQA: RoPE by explicit 2x2 rotations, explicit mask and softmax per head."""
    bs, s, _ = x.shape
    hd, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads

    def rope(t: torch.Tensor) -> torch.Tensor:  # [B, S, H, hd], pairs (2j, 2j+1)
        cos, sin = freqs.real[None, :, None, :], freqs.imag[None, :, None, :]
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)

    q = rope(attn.wq(x).view(bs, s, nh, hd))
    k = rope(attn.wk(x).view(bs, s, nkv, hd))
    v = attn.wv(x).view(bs, s, nkv, hd)
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool))
    heads = []
    for h in range(nh):
        g = h // (nh // nkv)  # query head h reads kv head g
        scores = q[:, :, h] @ k[:, :, g].transpose(-1, -2) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(scores, -1) @ v[:, :, g])
    return attn.wo(torch.cat(heads, -1))


@pytest.mark.parametrize("attn_type", ["sdpa", "flex"])
def test_gqa_attention_matches_naive(attn_type: str) -> None:
    args = replace(TINY, attn_type=attn_type)
    torch.manual_seed(0)
    attn = Attention(args)
    x = torch.randn(2, 16, args.dim)
    freqs = precompute_freqs_cis(args)[:16]
    mask = causal_block_mask(16, "cpu") if attn_type == "flex" else None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns it is unfused
        torch.testing.assert_close(
            attn(x, freqs, attn_mask=mask), naive_attention(attn, x, freqs), atol=1e-5, rtol=1e-5
        )


def test_flex_matches_sdpa_forward() -> None:
    sdpa = build(TINY)
    flex = build(replace(TINY, attn_type="flex"))
    flex.load_state_dict(sdpa.state_dict())
    tokens = torch.randint(0, TINY.vocab_size, (2, 48))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = sdpa(tokens)
        b = flex(tokens)
        b2 = flex(tokens)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(b, b2)
    # one BlockMask per (seq_len, device), built by the model and reused across calls and layers
    assert flex.block_masks.builds == 1


def test_rope_scaling_llama31() -> None:
    args = replace(llama3_configs["8B"], max_seq_len=4)
    plain = precompute_freqs_cis(replace(args, use_rope_scaling=False))[1].angle()
    scaled = precompute_freqs_cis(args)[1].angle()  # position 1: the angle is the frequency
    base = 1.0 / (args.rope_theta ** (torch.arange(0, 128, 2).float() / 128))
    torch.testing.assert_close(plain, base)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4  # short wavelengths: untouched
    low = wavelen > 8192 / 1  # long wavelengths: divided by 8
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    for f, got in zip(base[mid].tolist(), scaled[mid].tolist()):
        smooth = (8192 / (2 * math.pi / f) - 1) / (4 - 1)
        assert got == pytest.approx((1 - smooth) * f / 8 + smooth * f, rel=1e-5)
        assert f / 8 < got < f
    assert scaled[0] == plain[0]  # the highest frequency is the first pair


def test_overfit_fixed_batch() -> None:
    model = build(seed=3)
    torch.manual_seed(3)
    tokens = torch.randint(0, TINY.vocab_size, (4, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(TINY.vocab_size), rel=0.15)
    assert losses[-1] < 0.5 * losses[0]


def test_pipeline_stage_forward() -> None:
    full = build()
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    with torch.no_grad():
        expected = full(tokens)
        first, last = copy.deepcopy(full), copy.deepcopy(full)
        del first.layers["1"]
        first.norm = None
        first.output = None
        del last.layers["0"]
        last.tok_embeddings = None
        hidden = first(tokens)
        assert hidden.shape == (2, 8, TINY.dim) and hidden.is_floating_point()
        torch.testing.assert_close(last(hidden), expected)
    assert all(k.startswith("layers.1.") or k in ("norm.weight", "output.weight") for k in last.state_dict())
    # a stage counts only what it holds; init works on the partial module
    assert get_nparams_and_flops(first, 8)[0] < get_nparams_and_flops(full, 8)[0]
    # Init works on the partial module and keeps the original depth of layer "1". (The RNG
    # stream differs from the full model's, so PP parity runs need a seed checkpoint.)
    big = replace(TINY, dim=256, n_heads=8, n_kv_heads=4, vocab_size=512)
    stage = build(big)
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.init_weights()
    wo = stage.layers["1"].attention.wo.weight
    assert abs(wo.std().item() / (0.02 / math.sqrt(2 * 2)) - 1) < 0.1


def test_tied_embeddings_survive_to_empty() -> None:
    model = build(replace(TINY, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert model.tok_embeddings.weight.std().item() < 0.5  # output init, not the std-1 embedding
    nparams, _ = get_nparams_and_flops(model, 8)
    assert nparams == sum(p.numel() for p in build().parameters()) - TINY.vocab_size * TINY.dim


def test_validation_errors() -> None:
    with pytest.raises(TitanError, match="n_heads"):
        replace(TINY, dim=66).validate()
    with pytest.raises(TitanError, match="n_kv_heads"):
        replace(TINY, n_kv_heads=3).validate()
    with pytest.raises(TitanError, match="attn_type"):
        replace(TINY, attn_type="flash").validate()
    with pytest.raises(TitanError, match="flavor"):
        get_model_args("7B")
    with pytest.raises(TitanError, match="max_seq_len"):
        build()(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))
    for args in llama3_configs.values():
        args.validate()


def test_model_file_has_no_distributed_import() -> None:
    pattern = re.compile(r"^\s*(import|from)\s+torch\.distributed|torch\.distributed\.\w+\(", re.M)
    folder = pathlib.Path(llama_model.__file__).parent
    for name in ("model.py", "args.py", "flex.py"):
        assert not pattern.search((folder / name).read_text()), name
