"""Muon on one process: which parameters it takes (by role, for every family), its arithmetic
against torch.optim.Muon, the keys and their refusals, the AdamW kernel picked by default, and an
exact resume through DCP."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from tests.helpers.tiny import TINY
from titan.config.job_config import Optimizer as OptimizerConfig
from titan.errors import TitanError
from titan.models.llama import Transformer
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.llama4.model import Llama4Transformer as Llama4
from titan.models.moe import MoEArgs
from titan.training.muon import Muon, split_muon_params
from titan.training.optim import build_optimizers, resolve_implementation, validate_optimizer_config

MUON = OptimizerConfig(name="Muon", lr=3e-3, weight_decay=0.1)


def _llama4() -> nn.Module:
    args = Llama4ModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
        moe_args=MoEArgs(num_experts=4, top_k=2, num_shared_experts=1),
    )  # fmt: skip
    model = Llama4(args)
    model.init_weights()
    return model


def _names(model: nn.Module, params: list[nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_hidden_matrices_go_to_muon_the_rest_to_adamw() -> None:
    model = Transformer(TINY)
    matrices, others = split_muon_params(model)
    muon = _names(model, matrices)
    assert muon == {
        f"layers.{i}.{m}.weight"
        for i in range(TINY.n_layers)
        for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1")
        + ("feed_forward.w2", "feed_forward.w3")
    }
    assert _names(model, others) == {n for n, _ in model.named_parameters()} - muon  # embeddings, output, norms

    moe = _llama4()
    muon = _names(moe, split_muon_params(moe)[0])
    assert "layers.1.moe.experts.w1" in muon and "layers.1.moe.shared_experts.w1.weight" in muon
    assert not any("router" in n or "embeddings" in n or "norm" in n or n.startswith("output") for n in muon)
    assert any("router.gate" in n for n in _names(moe, split_muon_params(moe)[1]))
    on_muon = _names(moe, split_muon_params(moe, router_gate=True)[0])  # optimizer.muon_router_gate
    assert on_muon - muon == {"layers.1.moe.router.gate.weight"}, on_muon - muon


def test_biases_of_any_shape_go_to_adamw() -> None:
    """gpt-oss's routed experts carry per-expert biases [E, width]: 2-D, yet vectors, not matrices."""
    from titan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe
    from titan.models.gpt_oss.model import GptOssTransformer

    moe = dataclasses.replace(gpt_oss_moe(4), hidden_dim=16)
    args = GptOssModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, vocab_size=32, moe_args=moe)
    with torch.device("meta"):
        model = GptOssTransformer(args)
    matrices, others = split_muon_params(model)
    adamw = _names(model, others)
    assert {f"layers.0.moe.experts.b{i}" for i in (1, 2, 3)} <= adamw, adamw
    assert {"layers.0.attention.wq.bias", "layers.0.moe.router.gate.bias"} <= adamw, adamw
    assert all(p.ndim == 3 or "bias" not in n for n, p in model.named_parameters() if id(p) in map(id, matrices))
    assert {f"layers.0.moe.experts.w{i}" for i in (1, 2, 3)} <= _names(model, matrices)


def test_tied_output_stays_with_adamw() -> None:
    model = Transformer(dataclasses.replace(TINY, tie_embeddings=True))
    matrices, _ = split_muon_params(model)
    assert all(p is not model.tok_embeddings.weight for p in matrices)


def _torch_muon_reference(weights: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """torch.optim.Muon (Moonlight's lr adjustment) on each matrix; a 3-D stack as its E matrices."""
    flat = [nn.Parameter(m.clone()) for w in weights for m in (w if w.ndim == 3 else [w])]
    opt = torch.optim.Muon(flat, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in grads:
        for p, g in zip(flat, [m for gr in step for m in (gr if gr.ndim == 3 else [gr])]):
            p.grad = g.clone()
        opt.step()
    out, i = [], 0
    for w in weights:
        n = w.shape[0] if w.ndim == 3 else 1
        out.append(torch.stack([p.detach() for p in flat[i : i + n]]) if w.ndim == 3 else flat[i].detach())
        i += n
    return out


def test_update_is_torch_muon_per_matrix_and_per_expert() -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 24), (40, 8), (3, 8, 12)]  # wide, tall, an expert stack
    weights = [torch.randn(shape, generator=gen) for shape in shapes]
    grads = [[torch.randn(w.shape, generator=gen) for w in weights] for _ in range(3)]
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = Muon(params, lr=3e-3, weight_decay=0.1)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    for p, want in zip(params, _torch_muon_reference(weights, grads)):
        assert torch.equal(p.detach(), want)
    assert set(opt.state[params[0]]) == {"momentum_buffer"}  # one state tensor per matrix


def test_newton_schulz_is_torchs_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a tall matrix read through its transpose (how w1 and w3 arrive) at a size where CPU bf16
    matmuls change kernels (1536 x 512: writing each iteration into the transposed view was not
    torch's result), and a matrix wider than one column block (the blocked path)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    import titan.training.muon as muon

    gen = torch.Generator().manual_seed(0)
    for shape, block in (((1536, 512), None), ((16, 64), 256)):
        if block is not None:
            monkeypatch.setattr(muon, "_BLOCK", block)  # 16 rows x 16 columns per block
        m = torch.randn(shape, generator=gen)
        x = m.bfloat16()[None]
        muon.newton_schulz_(x.mT if shape[0] > shape[1] else x, 5)
        assert torch.equal(x[0], _zeropower_via_newtonschulz(m, muon.NS_COEFFICIENTS, 5, muon.EPS)), shape


def test_build_muon_with_adamw_and_its_own_keys() -> None:
    cfg = dataclasses.replace(MUON, adamw_lr=1e-3, adamw_weight_decay=0.0, momentum=0.9, nesterov=False, ns_steps=3)
    opt = build_optimizers([Transformer(TINY)], cfg)
    (muon,) = opt.optimizers  # one optimizer: one set of base lrs for the schedule, one checkpoint entry
    adamw = muon.adamw
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.param_groups[1:] == adamw.param_groups and muon.state is adamw.state
    group = muon.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"], group["nesterov"], group["ns_steps"]) == (
        3e-3, 0.1, 0.9, False, 3,
    )  # fmt: skip
    assert adamw.param_groups[0]["lr"] == 1e-3 and adamw.param_groups[0]["weight_decay"] == 0.0
    assert adamw.param_groups[0]["fused"] is True  # auto: CPU has torch's fused AdamW


@pytest.mark.parametrize(
    "override, message",
    [
        ({"early_step_in_backward": True}, "'optimizer.early_step_in_backward' got True; valid: false with Muon"),
        ({"momentum": 1.0}, "'optimizer.momentum' got 1.0; valid: a number in [0, 1)"),
        ({"ns_steps": 0}, "'optimizer.ns_steps' got 0; valid: an integer in [1, 99]"),
        ({"adamw_lr": -1.0}, "'optimizer.adamw_lr' got -1.0; valid: a number > 0"),
        ({"bf16_stochastic_round": True}, "'optimizer.name' got 'Muon'; valid: AdamW with optimizer.bf16_"),
        ({"name": "AdamW", "adamw_lr": 1e-3}, "'optimizer.name' got 'AdamW'; valid: Muon with optimizer.adamw_lr"),
        ({"name": "AdamW", "muon_router_gate": True}, "'optimizer.name' got 'AdamW'; valid: Muon with optimizer.muon_"),
    ],
)
def test_refusals_are_one_line(override: dict, message: str) -> None:
    cfg = dataclasses.replace(MUON, **override)
    with pytest.raises(TitanError) as info:
        cfg.validate()
        validate_optimizer_config(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_each_parts_lr_survives_a_resume() -> None:
    """The AdamW part's own lr and its decay-free group come back from the schedule's state."""
    from titan.config import load_config
    from titan.training.lr_scheduler import build_lr_schedulers

    cfg = load_config(["--optimizer.name", "Muon", "--optimizer.adamw_lr", "1e-4"])
    cfg.optimizer.weight_decay_exclude = ["norms"]
    runs = []
    for _ in range(2):
        opt = build_optimizers([Transformer(TINY)], cfg.optimizer)
        runs.append((opt, build_lr_schedulers(opt, cfg.lr_scheduler, 100)))
    (opt, sched), (opt2, sched2) = runs
    for _ in range(20):
        opt.step()
        sched.step()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    for o, s in runs:
        o.step()
        s.step()
    lrs = [[g["lr"] for o in run[0] for g in o.param_groups] for run in runs]
    assert lrs[0] == lrs[1] and len(set(lrs[0])) == 2, lrs  # Muon's lr, and AdamW's on both its groups


def test_auto_implementation() -> None:
    model = Transformer(TINY)
    assert resolve_implementation(OptimizerConfig(), [model]) == "fused"  # torch 2.13 has a CPU kernel
    assert resolve_implementation(OptimizerConfig(bf16_stochastic_round=True), [model]) == "foreach"
    assert resolve_implementation(OptimizerConfig(), [Transformer(TINY).to("meta")]) == "foreach"
    assert resolve_implementation(OptimizerConfig(implementation="for-loop"), [model]) == "for-loop"


def _steps(model: nn.Module, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        tokens = torch.randint(0, TINY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(step))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_resume_through_dcp_is_bitwise(tmp_path) -> None:
    torch.manual_seed(0)
    model = Transformer(TINY)
    model.init_weights()
    twin = Transformer(TINY)
    twin.load_state_dict(model.state_dict())
    opt = build_optimizers([model], MUON)
    _steps(model, opt, 0, 3)
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(tmp_path))
    assert any(k.endswith("momentum_buffer") for k in opt.state_dict())
    assert any(k.endswith("exp_avg_sq") for k in opt.state_dict())
    _steps(model, opt, 3, 6)

    twin_opt = build_optimizers([twin], MUON)
    _steps(twin, twin_opt, 0, 1)  # creates the states the load fills
    state = {"model": twin.state_dict(), "optimizer": twin_opt.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    twin.load_state_dict(state["model"])
    twin_opt.load_state_dict(state["optimizer"])
    _steps(twin, twin_opt, 3, 6)
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), name


def test_an_adamw_checkpoint_resumes_with_muon_only_without_its_optimizer_state(tmp_path) -> None:
    from titan.checkpointing.config_diff import resolve, snapshot, write_config
    from titan.config import load_config

    write_config(str(tmp_path), snapshot(load_config([]), 1))
    muon = snapshot(load_config(["--optimizer.name", "Muon"]), 1)
    for policy in ("error", "use_new"):  # the moments cannot become momentum buffers: say what works
        with pytest.raises(TitanError, match="optimizer state is AdamW's.*exclude_from_loading optimizer$") as info:
            resolve(str(tmp_path), muon, policy)
        assert "\n" not in str(info.value) and "use_new" not in str(info.value)
    other = snapshot(load_config(["--optimizer.name", "Muon", "--training.seq_len", "4096"]), 1)
    with pytest.raises(TitanError, match=r"exclude_from_loading optimizer \(and --checkpoint.config_mismatch for"):
        resolve(str(tmp_path), other, "error")
    assert resolve(str(tmp_path), muon, "error", excluded=["optimizer"]) == {}


def test_memory_estimate_counts_one_momentum_per_matrix() -> None:
    """The estimate's optimizer states are the bytes a real Muon step allocates (fp32, one rank)."""
    from titan.config import load_config
    from titan.data import build_tokenizer
    from titan.models import get_model_spec, model_args_from_config
    from titan.training.memory import estimate_memory

    small = ("--training.seq_len", "32", "--training.local_batch_size", "1")
    config = load_config(["--optimizer.name", "Muon", *small])
    est, adamw = estimate_memory(config, 1), estimate_memory(load_config(list(small)), 1)
    spec = get_model_spec(config.model.name)
    args = model_args_from_config(spec, config.model)
    args.vocab_size = build_tokenizer(config.model.tokenizer_path).vocab_size  # as the trainer sizes it
    model = spec.model_cls(args)
    opt = build_optimizers([model], config.optimizer)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    states = sum(t.numel() * t.element_size() for o in opt for s in o.state.values() for t in s.values() if t.ndim)
    assert est.categories["optimizer_state"] == states < adamw.categories["optimizer_state"]
    assert est.optimizer_states == "Muon 1 x fp32 on matrices, AdamW 2 x fp32 on the rest"
