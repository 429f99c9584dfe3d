from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan.config.job_config import Optimizer as OptimizerConfig
from titan.errors import TitanError
from titan.training.optim import OptimizersContainer, build_optimizers, validate_optimizer_config


class Tiny(nn.Module):
    """Stand-in for a model whose pipeline split keeps the original FQNs (layers.<i>...)."""

    def __init__(self, n_layers: int = 3, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(dim, dim) for i in range(n_layers)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def _split(model: Tiny, keep: list[str]) -> Tiny:
    part = copy.deepcopy(model)
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    return part


def _train(parts: list[nn.Module], opt: OptimizersContainer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        for part in parts:
            x = part(x)
        opt.zero_grad()
        x.pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_build_each_implementation(name: str, impl: str) -> None:
    cfg = OptimizerConfig(name=name, lr=1e-3, weight_decay=0.01, implementation=impl)
    model = Tiny()
    opt = build_optimizers([model], cfg)
    assert len(opt) == 1
    torch_opt = opt.optimizers[0]
    assert type(torch_opt).__name__ == name
    group = torch_opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.95) and group["eps"] == 1e-8
    assert group["foreach"] is (impl == "foreach")
    assert group["fused"] is (impl == "fused")
    before = [p.detach().clone() for p in model.parameters()]
    _train([model], opt, steps=1, seed=0)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_implementations_agree() -> None:
    results = []
    for impl in ("for-loop", "foreach", "fused"):
        torch.manual_seed(0)
        model = Tiny()
        opt = build_optimizers([model], OptimizerConfig(implementation=impl))
        _train([model], opt, steps=3, seed=1)
        results.append(torch.cat([p.flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1])
    torch.testing.assert_close(results[0], results[2])


@pytest.mark.parametrize(
    "override, message",
    [
        ({"lr": -1.0}, "config key 'optimizer.lr' got -1.0; valid: a number > 0"),
        ({"lr": 0.0}, "config key 'optimizer.lr' got 0.0; valid: a number > 0"),
        ({"name": "SGD"}, "config key 'optimizer.name' got 'SGD'; valid: AdamW, Adam"),
        ({"beta1": 1.0}, "config key 'optimizer.beta1' got 1.0; valid: a number in [0, 1)"),
        ({"beta2": -0.1}, "config key 'optimizer.beta2' got -0.1; valid: a number in [0, 1)"),
        ({"eps": -1e-8}, "config key 'optimizer.eps' got -1e-08; valid: a number >= 0"),
        ({"weight_decay": -0.1}, "config key 'optimizer.weight_decay' got -0.1; valid: a number >= 0"),
    ],
)
def test_bad_config(override: dict, message: str) -> None:
    cfg = dataclasses.replace(OptimizerConfig(), **override)
    with pytest.raises(TitanError) as info:
        cfg.validate()  # the ranges (load_config)
        validate_optimizer_config(cfg)  # the name against the optimizer table (validate_job)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_name_is_case_insensitive() -> None:
    opt = build_optimizers([Tiny()], OptimizerConfig(name="adamw"))
    assert isinstance(opt.optimizers[0], torch.optim.AdamW)


def test_fused_unsupported_is_a_clear_error() -> None:
    # Meta tensors are not a fused-kernel device: torch refuses at construction.
    model = Tiny().to("meta")
    with pytest.raises(TitanError, match="optimizer.implementation=fused is not supported"):
        build_optimizers([model], OptimizerConfig(implementation="fused"))


def test_state_dict_is_fqn_keyed_and_merges_parts() -> None:
    torch.manual_seed(0)
    model = Tiny()
    parts = [_split(model, ["0"]), _split(model, ["1", "2"])]
    opt = build_optimizers(parts, OptimizerConfig())
    _train(parts, opt, steps=2, seed=0)
    sd = opt.state_dict()
    for i in range(3):
        assert f"state.layers.{i}.weight.exp_avg" in sd
        assert f"param_groups.layers.{i}.weight.lr" in sd


def test_hooks_run_after_all_parts_step() -> None:
    model = Tiny()
    parts = [_split(model, ["0"]), _split(model, ["1", "2"])]
    opt = build_optimizers(parts, OptimizerConfig())
    calls = []
    opt.register_step_post_hook(lambda: calls.append([len(o.state) > 0 for o in opt]))
    _train(parts, opt, steps=1, seed=0)
    assert calls == [[True, True]]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_across_layouts_matches_uninterrupted(tmp_path) -> None:
    """Two pipeline-style parts save; one whole model loads (via DCP) and continues exactly."""
    torch.manual_seed(0)
    reference = Tiny()
    start = copy.deepcopy(reference)
    ref_opt = build_optimizers([reference], OptimizerConfig())
    _train([reference], ref_opt, steps=3, seed=0)
    _train([reference], ref_opt, steps=2, seed=1)

    parts = [_split(start, ["0"]), _split(start, ["1", "2"])]
    opt = build_optimizers(parts, OptimizerConfig())
    _train(parts, opt, steps=3, seed=0)
    model_sd = {**parts[0].state_dict(), **parts[1].state_dict()}
    dcp.save({"model": model_sd, "optimizer": opt.state_dict()}, checkpoint_id=str(tmp_path))

    resumed = Tiny()
    resumed_opt = build_optimizers([resumed], OptimizerConfig())
    state = {"model": resumed.state_dict(), "optimizer": resumed_opt.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(state["model"])
    resumed_opt.load_state_dict(state["optimizer"])
    _train([resumed], resumed_opt, steps=2, seed=1)

    for (name, p_ref), p_res in zip(reference.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(p_res, p_ref, rtol=0, atol=0, msg=name)
