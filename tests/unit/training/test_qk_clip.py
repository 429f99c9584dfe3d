"""QK-clip on one process, every family: the rescale each attention module asks for against the factor
worked out by hand per head (llama3 and gpt-oss: grouped heads take their group's smallest gamma, with
gpt-oss's biases; qwen3 and qwen3_5: the layer's smallest, through the shared q/k norm weights, qwen3_5's
scaling by 1 + weight; llama4: nothing on its weightless-normed blocks; deepseek_v3's MLA: gamma per
head, for both query shapes, with the shared rotary key, values and low-rank query untouched); a step
whose logits exceed tau leaves the recomputed maximum at tau; and the refusals, one line each."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from tests.helpers.deepseek import DSTEST
from tests.helpers.parity import REPO
from tests.helpers.tiny import TINY
from titan.config import load_config
from titan.errors import TitanError
from titan.models.deepseek_v3.model import DeepSeekV3Transformer, MLAttention
from titan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe
from titan.models.gpt_oss.model import GptOssTransformer
from titan.models.llama.model import Transformer
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.llama4.model import Llama4Transformer
from titan.models.moe import MoEArgs
from titan.models.qwen3.args import Qwen3ModelArgs
from titan.models.qwen3.model import Qwen3Transformer
from titan.models.qwen3_5.args import Qwen35ModelArgs
from titan.models.qwen3_5.model import Qwen35Transformer
from titan.parallel.dims import ParallelDims
from titan.training.qk_clip import PER_LAYER_PREFIX, QKClip, attention_modules, check_qk_clip, clip_gammas, rescale_

SEQ = 16
# grouped: 2 query heads per key head
HEADS: dict[str, Any] = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64)
QWEN3 = Qwen3ModelArgs(**HEADS, head_dim=8, hidden_dim=40)
# layer 0: NoPE, no norm (llama's rescale); layer 1: RoPE with q/k L2-normalised (nothing to scale)
LLAMA4 = Llama4ModelArgs(**HEADS, every_n_layers_nope=2, use_qk_norm=True, moe_args=MoEArgs(num_experts=4, top_k=2))
# layers 0 and 2: Gated DeltaNet (no attention logits); 1 and 3: gated attention, norms of 1 + weight
QWEN3_5 = Qwen35ModelArgs(
    **{**HEADS, "n_layers": 4}, head_dim=8, hidden_dim=40, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2,
)  # fmt: skip
GPT_OSS = GptOssModelArgs(**HEADS, head_dim=8, moe_args=dataclasses.replace(gpt_oss_moe(4), top_k=2, hidden_dim=24))
FAMILIES = {
    "llama3": lambda: Transformer(dataclasses.replace(TINY, n_heads=8, n_kv_heads=2)),
    "qwen3": lambda: Qwen3Transformer(dataclasses.replace(QWEN3)),
    "llama4": lambda: Llama4Transformer(dataclasses.replace(LLAMA4)),
    "deepseek_v3": lambda: DeepSeekV3Transformer(dataclasses.replace(DSTEST, n_layers=2, vocab_size=64)),
    "deepseek_v3_wq": lambda: DeepSeekV3Transformer(dataclasses.replace(DSTEST, n_layers=2, q_lora_rank=0)),
    "gpt_oss": lambda: GptOssTransformer(dataclasses.replace(GPT_OSS)),
    "qwen3_5": lambda: Qwen35Transformer(dataclasses.replace(QWEN3_5)),
}


def _model(family: str):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.model_args.max_seq_len = max(model.model_args.max_seq_len, SEQ)
    model.init_weights()
    with torch.no_grad():  # sharper attention (logits well above 1), biases that matter
        for name, p in model.named_parameters():
            if name.endswith(("wq.weight", "wk.weight", "wq_b.weight", "wkv_b.weight")):
                p.mul_(8.0)
            elif name.endswith(("wq.bias", "wk.bias")):
                p.normal_(0, 0.5)
    return model


def _attention_calls(model, tokens: torch.Tensor) -> list[tuple]:
    """Every attention module's call (module, args, kwargs) in a forward: replayed, each sees the
    same input however a clip changes the layers before it."""
    calls: list[tuple] = []
    hooks = [
        m.register_forward_pre_hook(lambda m, a, kw: calls.append((m, a, kw)), with_kwargs=True)
        for m in attention_modules([model])
    ]
    model(tokens)
    for h in hooks:
        h.remove()
    return calls


def _logits(call: tuple) -> torch.Tensor:
    """[B, H, S, S]: the q . k of every query head and its key head, all pairs, as its kernel gets them."""
    att, args, kwargs = call
    seen = []
    hook = att.inner_attention.register_forward_pre_hook(lambda m, a: seen.append(a[:2]))
    att(*args, **kwargs)
    hook.remove()
    [(q, k)] = seen
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5


def _expected_factor(family: str, att, gamma: torch.Tensor) -> torch.Tensor:
    """Per head, by hand: what the clip should multiply the head's logits by."""
    if family.startswith("deepseek"):
        return gamma  # every head its own key
    if family.startswith("qwen3"):
        return gamma.min().expand(att.n_heads)  # one norm weight for all heads
    if family == "llama4" and att.qk_norm_eps is not None:
        return torch.ones(att.n_heads)  # nothing to scale
    rep = att.n_heads // att.n_kv_heads
    return gamma.view(-1, rep).min(dim=1).values.repeat_interleave(rep)  # the shared key's group


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rescale_scales_each_heads_logits_by_the_hand_worked_factor(family) -> None:
    model = _model(family)
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    for call in _attention_calls(model, tokens):
        att = call[0]
        gamma = torch.linspace(0.3, 1.0, att.n_heads)[torch.randperm(att.n_heads, generator=torch.Generator())]
        gamma[0] = 1.0  # a head under tau: exactly 1
        before = {n: p.detach().clone() for n, p in att.named_parameters()}
        with torch.no_grad():
            logits = _logits(call)
            for part in att.qk_clip_scales(gamma):
                rescale_(part)
            after = _logits(call)
        factor = _expected_factor(family, att, gamma).view(1, -1, 1, 1)
        torch.testing.assert_close(after, logits * factor, rtol=1e-5, atol=1e-6)
        changed = {n for n, p in att.named_parameters() if not torch.equal(p, before[n])}
        if isinstance(att, MLAttention):
            assert changed == {"wq.weight" if att.q_lora_rank == 0 else "wq_b.weight", "wkv_b.weight"}
            shape, nope = (att.n_heads, -1, att.kv_lora_rank), att.nope_dim  # wkv_b's value rows of every head
            assert torch.equal(att.wkv_b.weight.view(shape)[:, nope:], before["wkv_b.weight"].view(shape)[:, nope:])
        elif family.startswith("qwen3"):
            assert changed == {"q_norm.weight", "k_norm.weight"}
        elif family == "gpt_oss":
            assert changed == {"wq.weight", "wk.weight", "wq.bias", "wk.bias"}  # sinks, v and o stay
        elif family == "llama4" and att.qk_norm_eps is not None:
            assert changed == set()
        else:
            assert changed == {"wq.weight", "wk.weight"}


def _maxima(model, clip: QKClip, run) -> torch.Tensor:
    """Per layer, the largest logit ``run()`` makes, through a tracked step and its optimizer hook."""
    clip.track(1, log_step=True)
    run()
    clip.after_step()
    values = clip.log_tensors()
    return torch.stack([values[f"{PER_LAYER_PREFIX}layers.{i}/max_logit"] for i in clip.layers])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_over_tau_are_held_at_tau(family) -> None:
    model = _model(family)
    dims = ParallelDims(1, 1, 1, 1, 1, 1)
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(2))
    probe = QKClip(None, [model], dims, torch.device("cpu"), "sdpa")  # the metric alone: no clip
    calls: list[tuple] = []
    first = _maxima(model, probe, lambda: calls.extend(_attention_calls(model, tokens)))

    def replay() -> None:
        for m, a, kw in calls:
            m(*a, **kw)

    assert torch.equal(_maxima(model, probe, replay), first)  # weights untouched
    normed = torch.tensor([family == "llama4" and m.qk_norm_eps is not None for m in attention_modules([model])])
    tau = 0.8 * first[~normed].min().item()  # every layer that can be clipped is
    clip = QKClip(tau, [model], dims, torch.device("cpu"), "sdpa")
    assert torch.equal(_maxima(model, clip, replay), first)  # before the clip
    held = _maxima(model, clip, replay)
    torch.testing.assert_close(held, torch.where(normed, first, torch.full_like(first, tau)), rtol=1e-5, atol=0)


def test_clip_gammas_leave_heads_under_tau_and_non_finite_maxima_alone() -> None:
    table = torch.tensor([[50.0, 200.0, -math.inf], [math.nan, math.inf, 100.0]])
    assert clip_gammas(table, 100.0).tolist() == [[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]]


def _config(*flags: str):
    return load_config(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), *flags])


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_threshold_must_be_a_positive_number(value) -> None:
    with pytest.raises(TitanError, match="optimizer.qk_clip_threshold.*a number > 0, or unset"):
        _config("--optimizer.qk_clip_threshold", value)


def test_layouts_qk_clip_refuses() -> None:
    cp_sdpa = _config("--optimizer.qk_clip_threshold", "100", "--parallelism.context_parallel_degree", "2")
    with pytest.raises(TitanError, match='needs model.attn_type = "flex"'):
        check_qk_clip(cp_sdpa, ParallelDims(1, 1, 2, 1, 1, 2))
    check_qk_clip(_config("--parallelism.context_parallel_degree", "2"), ParallelDims(1, 1, 2, 1, 1, 2))  # off: fine
    ft = _config("--optimizer.qk_clip_threshold", "100", "--fault_tolerance.enable")
    with pytest.raises(TitanError, match="fault_tolerance.enable"):
        check_qk_clip(ft, ParallelDims(1, 1, 1, 1, 1, 1))


def test_tracking_runs_every_step_when_clipping_else_on_the_metrics_log_steps() -> None:
    model = _model("llama3")
    kernels = [b.attention.inner_attention for b in model.layers.values()]
    dims = ParallelDims(1, 1, 1, 1, 1, 1)

    def tracked(clip: QKClip, step: int, log_step: bool) -> bool:
        clip.track(step, log_step)
        assert {k.track_logits for k in kernels} == {clip._tracking}
        return clip._tracking

    metric = QKClip(None, [model], dims, torch.device("cpu"), "sdpa", metric_freq=10)  # metrics.max_logit_freq
    assert [tracked(metric, s, True) for s in (1, 2, 5, 10, 20)] == [True, False, False, True, True]
    assert not tracked(metric, 10, False)  # not a log step
    never = QKClip(None, [model], dims, torch.device("cpu"), "sdpa", metric_freq=0)
    assert not tracked(never, 1, True)
    clip = QKClip(1.0, [model], dims, torch.device("cpu"), "sdpa", metric_freq=0)
    assert all(tracked(clip, s, False) for s in (1, 2, 3))
    assert clip.log_tensors() == {}  # nothing tracked yet: nothing to log
    # SDPA under context parallelism has no logits to take: the metric is left out
    assert not tracked(QKClip(None, [model], ParallelDims(1, 1, 2, 1, 1, 2), torch.device("cpu"), "sdpa"), 1, True)
