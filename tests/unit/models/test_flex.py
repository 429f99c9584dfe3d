"""flex attention: the mask is the model's (built once per batch, outside the blocks), the kernel is
compiled per model, nothing is module-global; CPU runs the forward only and refuses training.

The CUDA tests check that flex with compile and every AC mode on a 4-layer model with head_dim 128
at seq 4096 tracks sdpa within bf16 tolerance for 10 steps, at >= 0.9x its tokens/s.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from dataclasses import replace

import pytest
import torch

import titan.models.llama.flex as flex_mod
from tests.helpers import tiny
from titan.errors import TitanError
from titan.models.llama import Transformer, TransformerModelArgs
from titan.models.llama.model import Attention, RMSNorm, precompute_freqs_cis
from titan.parallel.ac import apply_ac
from titan.parallel.compile import apply_compile
from titan.training.loss import cross_entropy_sum

TINY = replace(tiny.TINY, n_layers=3, max_seq_len=256)
AC_CASES = [("none", "op"), ("selective", "op"), ("full", "op")]


def _pair(args: TransformerModelArgs = TINY, device: str = "cpu") -> tuple[Transformer, Transformer]:
    torch.manual_seed(0)
    with torch.device(device):
        sdpa = Transformer(copy.deepcopy(args))
        sdpa.init_weights()
        flex = Transformer(replace(args, attn_type="flex"))
    flex.load_state_dict(sdpa.state_dict())
    return sdpa, flex


def _module_state() -> dict[str, dict[str, tuple[int, int]]]:
    """id and size of every global of every titan.models module."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if name.startswith("titan.models"):
            out[name] = {k: (id(v), len(v) if isinstance(v, (dict, list, set)) else -1) for k, v in vars(mod).items()}
    return out


def test_flex_forward_matches_sdpa_and_keeps_no_module_state() -> None:
    sdpa, flex = _pair()
    before = _module_state()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns it is unfused
        for seq in (48, 200, 48):  # 200: not a multiple of the 128-token mask block
            tokens = torch.randint(0, TINY.vocab_size, (2, seq))
            torch.testing.assert_close(flex(tokens), sdpa(tokens), atol=1e-5, rtol=1e-5)
    assert _module_state() == before  # no cache filled at module level
    assert flex.block_masks.builds == 2  # one per new length, reused for 48 the second time
    other = _pair()[1]
    assert other.block_masks is not flex.block_masks
    assert other.layers["0"].attention.inner_attention.kernel is not flex.layers["0"].attention.inner_attention.kernel
    # one kernel (one compiled flex_attention) shared by all layers of a model
    kernels = {id(b.attention.inner_attention.kernel) for b in flex.layers.values()}
    assert len(kernels) == 1


def test_mask_is_built_once_per_forward_not_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = flex_mod.create_block_mask
    monkeypatch.setattr(flex_mod, "create_block_mask", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    _, flex = _pair()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex(torch.zeros(1, 64, dtype=torch.long))
        assert calls == [64]  # 3 layers, one mask
        flex(torch.zeros(2, 64, dtype=torch.long))
        assert calls == [64]  # cached on the model
        flex(torch.zeros(1, 32, dtype=torch.long))
        assert calls == [64, 32]


def test_attention_without_the_model_mask_is_an_error() -> None:
    attn = Attention(replace(TINY, attn_type="flex"))
    x = torch.randn(1, 16, TINY.dim)
    with pytest.raises(TitanError, match="BlockMask built by Transformer.forward"):
        attn(x, precompute_freqs_cis(TINY)[:16])


def test_cpu_flex_has_no_backward_and_training_is_refused_before_the_model() -> None:
    """What torch 2.13 does on CPU: forward without grad works (above); with grad it raises, so the
    trainer refuses flex on CPU at its layout check, with one line naming the key and the fix."""
    _, flex = _pair()
    with pytest.raises(NotImplementedError, match="backward on CPU"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex(torch.zeros(1, 16, dtype=torch.long))
    from titan.parallel.dims import ParallelDims, check_layout

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    with pytest.raises(TitanError, match=r'model.attn_type = "flex" cannot train on CPU .* use "sdpa" on CPU'):
        check_layout(dims, None, TINY, 64, "cpu", "flex")
    check_layout(dims, None, TINY, 64, "cuda", "flex")  # and a dry run checks as for CUDA


def test_trainer_on_cpu_with_flex_gives_one_line(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from titan.config import load_config
    from titan.training.trainer import Trainer

    built = []
    monkeypatch.setattr(Transformer, "__init__", lambda *a, **k: built.append(1))
    cfg = load_config(["--model.attn_type", "flex", "--job.dump_folder", str(tmp_path), "--training.steps", "1"])
    with pytest.raises(TitanError, match="cannot train on CPU") as e:
        Trainer(cfg)
    assert "\n" not in str(e.value) and not built


def test_rmsnorm_is_torch_fused_with_the_fp32_semantics() -> None:
    norm = RMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(4, 7, 64) * 3
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    # The mean of 64 float32 squares, summed in the kernel's order: ~64 * eps relative error, which
    # the rsqrt and the products carry per element (relative); atol: one rounding at the largest value.
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(norm(x), ref, atol=eps * float(ref.detach().abs().max()), rtol=64 * eps)
    xb = x.bfloat16()
    old = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(xb)
    torch.testing.assert_close(norm(xb).float(), (old.float() * norm.weight).float(), atol=0.05, rtol=1e-2)
    assert set(norm.state_dict()) == {"weight"}


@pytest.mark.slow
@pytest.mark.parametrize("mode,option", AC_CASES)
def test_cpu_compiled_checkpointed_flex_forward(mode: str, option: str) -> None:
    """dynamo rejects create_block_mask inside a compiled, checkpointed block; with the mask passed
    in, each AC mode traces (fullgraph) and matches sdpa on CPU."""
    sdpa, flex = _pair(replace(TINY, n_layers=2))
    apply_ac(flex, mode, option)
    apply_compile(flex)
    tokens = torch.randint(0, TINY.vocab_size, (2, 128))
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens), sdpa(tokens), atol=1e-5, rtol=1e-5)
    assert flex.block_masks.builds == 1


# ---------------------------------------------------------------------------------------------- CUDA

GPU_ARGS = TransformerModelArgs(
    dim=1024, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=2048, multiple_of=256, max_seq_len=4096
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _train(model: Transformer, tokens: torch.Tensor, steps: int) -> tuple[list[float], float]:
    """bf16-autocast AdamW steps; returns the losses and tokens/s over the steps after the 3rd."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses, start = [], None
    for step in range(steps):
        if step == 3:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy_sum(model(inputs), labels) / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    return losses, labels.numel() * (steps - 3) / (time.perf_counter() - start)


@cuda
@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("mode,option", AC_CASES)
def test_cuda_flex_compiled_matches_sdpa_and_keeps_its_speed(mode: str, option: str) -> None:
    sdpa, flex = _pair(GPU_ARGS, device="cuda")
    for model in (sdpa, flex):
        apply_ac(model, mode, option)
        apply_compile(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, GPU_ARGS.vocab_size, (1, 4097), generator=g).cuda()
    for model in (sdpa, flex):  # compile both (forward and backward) before timing anything
        start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        _train(model, tokens, 4)
        model.load_state_dict(start)
    ref, ref_tps = _train(sdpa, tokens, 10)
    got, tps = _train(flex, tokens, 10)
    assert abs(got[0] - ref[0]) / ref[0] < 5e-3, (got[0], ref[0])  # the forward itself agrees
    for step, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) / b < 3e-2, (step, got, ref)
    assert tps >= 0.9 * ref_tps, (mode, tps, ref_tps)


@cuda
@pytest.mark.cuda
def test_cuda_flex_attention_output_matches_sdpa_at_head_dim_128() -> None:
    """One attention call at the Llama 3 8B attention shape (32 heads, 8 kv heads, head_dim 128, seq 8192),
    eager model-level path (compiled flex kernel) against SDPA in bf16."""
    args = TransformerModelArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, vocab_size=256, max_seq_len=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        sdpa_attn = Attention(args).bfloat16()
        flex_attn = Attention(replace(args, attn_type="flex")).bfloat16()
    flex_attn.load_state_dict(sdpa_attn.state_dict())
    x = torch.randn(1, 8192, 4096, device="cuda", dtype=torch.bfloat16)
    freqs = precompute_freqs_cis(args, device="cuda")
    mask = flex_mod.causal_block_mask(8192, "cuda")
    with torch.no_grad():
        torch.testing.assert_close(flex_attn(x, freqs, block_mask=mask), sdpa_attn(x, freqs), atol=2e-2, rtol=2e-2)
