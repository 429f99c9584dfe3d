"""Activation checkpointing: which blocks get wrapped, what gets recomputed, and exact gradients."""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import replace

import pytest
import torch
import torch._functorch.config as functorch_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from tests.helpers.tiny import TINY, batch, build, patch_flavors
from titan.config import load_config
from titan.config.sections.activation_checkpoint import ActivationCheckpoint
from titan.errors import TitanError
from titan.parallel.ac import (
    ATTENTION_OPS,
    _context_fn,
    _op_policy,
    apply_ac,
    parse_selective_option,
    recomputed_attention_breaks_compile,
)
from titan.parallel.init import canonical_fqn
from titan.training.checks import load_job
from titan.training.loss import cross_entropy_sum

FOUR = replace(TINY, n_layers=4)


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _grads_and_backward_mms(model):
    inputs, labels = batch(FOUR)
    loss = cross_entropy_sum(model(inputs), labels)
    with CountMatmuls() as counter:
        loss.backward()
    grads = {canonical_fqn(n): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, counter.count


@pytest.fixture(scope="module")
def eager():
    return _grads_and_backward_mms(build(FOUR))


# 7 Linear layers per block; backward does 2 matmuls per Linear (grad input, grad weight).
# Full AC re-runs the forward matmuls; the recompute stops early once everything backward needs
# exists, so the block's last matmul (w2, whose output nothing saves) is not re-run: 6 extra.
# "op" keeps the 1st, 3rd, 5th, 7th matmul outputs and re-runs only the 2nd, 4th, 6th: 3 extra.
@pytest.mark.parametrize(
    "mode, option, wrapped, extra_mms_per_wrapped_block",
    [
        ("full", "op", ["0", "1", "2", "3"], 6),
        ("selective", "op", ["0", "1", "2", "3"], 3),
        ("selective", "3", ["0", "3"], 6),
    ],
)
def test_ac_wraps_and_recomputes_as_claimed(eager, mode, option, wrapped, extra_mms_per_wrapped_block):
    model = build(FOUR)
    assert apply_ac(model, mode, option) == wrapped
    for name, block in model.layers.named_children():
        assert isinstance(block, CheckpointWrapper) == (name in wrapped), name
    loss, grads, mms = _grads_and_backward_mms(model)
    ref_loss, ref_grads, ref_mms = eager
    assert ref_mms == FOUR.n_layers * 14 + 2  # + the output projection
    assert mms - ref_mms == extra_mms_per_wrapped_block * len(wrapped)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


def test_none_leaves_model_alone():
    model = build(FOUR)
    before = copy.deepcopy(dict(model.layers.named_children()))
    assert apply_ac(model, "none") == []
    assert [type(b) for b in model.layers.values()] == [type(b) for b in before.values()]


@pytest.mark.parametrize("option", [0, -1, "ops", "two", True])
def test_bad_selective_option(option):
    with pytest.raises(TitanError, match="selective_ac_option"):
        parse_selective_option(option)


def test_config_is_validated_before_anything_runs():
    with pytest.raises(TitanError, match="activation_checkpoint.mode"):
        load_config(["--activation_checkpoint.mode", "partial"])
    with pytest.raises(TitanError, match="selective_ac_option"):
        load_job(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"])
    cfg = load_config(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"])
    assert cfg.activation_checkpoint.selective_ac_option == 2


def test_forced_recompute_shapes_leave_the_every_other_count():
    # w1 and w3 share their shape: both are recomputed and not counted, so the saved matmuls are
    # wq, wv and w2 and the recomputed ones wk, wo, w1, w3 (4 per block instead of 3).
    model = build(FOUR)
    ac = ActivationCheckpoint(
        mode="selective", selective_ac_option="op", per_op_sac_force_recompute_mm_shapes_by_fqns=["feed_forward.w1"]
    )
    assert apply_ac(model, ac) == ["0", "1", "2", "3"]
    _, _, mms = _grads_and_backward_mms(model)
    assert mms - (FOUR.n_layers * 14 + 2) == 4 * FOUR.n_layers
    with pytest.raises(TitanError, match="per_op_sac_force_recompute_mm_shapes_by_fqns' matched layers.0.attention "):
        apply_ac(build(FOUR), replace(ac, per_op_sac_force_recompute_mm_shapes_by_fqns=["attention"]))


def test_checkpoint_settings_reach_the_wrapper():
    ac = ActivationCheckpoint(
        mode="full", preserve_rng_state=True, early_stop=False, determinism_check="none", debug=True
    )
    model = build(FOUR)
    apply_ac(model, ac)
    keywords = model.layers["0"].checkpoint_fn.keywords
    assert {k: keywords[k] for k in ("preserve_rng_state", "early_stop", "determinism_check", "debug")} == {
        "preserve_rng_state": True,
        "early_stop": False,
        "determinism_check": "none",
        "debug": True,
    }


def test_per_op_recompute_may_annotate_differently_from_the_forward():
    """A nested FSDP unit (EP's experts) opens one more profiler annotation in the recompute than
    in the forward: the per-op policy's recompute must not take it for a missing activation."""
    calls = []
    weight = torch.randn(8, 8, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        if len(calls) == 2:  # the recompute, as FSDP's root_pre_forward there
            with torch.profiler.record_function("recompute only"):
                pass
        with torch.profiler.record_function("both"):
            return torch.relu(x @ weight) @ weight

    x = torch.randn(4, 8)
    (expected,) = torch.autograd.grad(block(x).sum(), weight)
    calls.clear()
    context_fn = _context_fn(frozenset(), keep_attention=False)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    (grad,) = torch.autograd.grad(out.sum(), weight)
    assert len(calls) == 2
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_per_op_policy_keeps_device_to_host_copies_only():
    policy = _op_policy()
    ctx = SelectiveCheckpointContext(is_recompute=False)
    on_device = torch.empty(4, device="meta")  # stands for an accelerator's tensor
    to_copy = torch.ops.aten._to_copy.default
    assert policy(ctx, to_copy, on_device, device=torch.device("cpu")) == CheckpointPolicy.MUST_SAVE
    assert policy(ctx, to_copy, on_device, dtype=torch.bfloat16) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(ctx, to_copy, torch.empty(4), device="cpu") == CheckpointPolicy.PREFER_RECOMPUTE


class CountAttention(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_kept_attention_is_not_recomputed():
    # The TP + compile + CPU workaround: full recomputation except attention, same gradients.
    assert recomputed_attention_breaks_compile("cpu", tp_enabled=True, compiled=True)
    assert not recomputed_attention_breaks_compile("cpu", tp_enabled=True, compiled=False)
    assert not recomputed_attention_breaks_compile("cpu", tp_enabled=False, compiled=True)
    assert not recomputed_attention_breaks_compile("cuda", tp_enabled=True, compiled=True)
    counts = []
    for keep in (False, True):
        model = build()
        apply_ac(model, "full", keep_attention=keep)
        inputs, labels = batch()
        loss = cross_entropy_sum(model(inputs), labels)
        with CountAttention() as counter:
            loss.backward()
        counts.append(counter.count)
    assert counts[0] > counts[1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--activation_checkpoint.memory_budget", "1.5"], "config key 'activation_checkpoint.memory_budget' got 1.5"),
        (
            ["--activation_checkpoint.memory_budget", "-0.1"],
            "config key 'activation_checkpoint.memory_budget' got -0.1",
        ),
        (["--activation_checkpoint.determinism_check", "strict"], "activation_checkpoint.determinism_check"),
        (["--activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns", '[""]'], "per_op_sac_force"),
        (["--activation_checkpoint.early_stop=maybe"], "activation_checkpoint.early_stop"),
        (["--activation_checkpoint.preserve_rng_state=2"], "activation_checkpoint.preserve_rng_state"),
        (["--activation_checkpoint.debug=x"], "activation_checkpoint.debug"),
        (["--activation_checkpoint.visualize_memory_budget_pareto=x"], "visualize_memory_budget_pareto"),
        (
            ["--activation_checkpoint.mode", "memory_budget"],
            "'activation_checkpoint.mode' = \"memory_budget\" needs compile",
        ),
        (
            ["--activation_checkpoint.mode", "memory_budget", "--compile.enable", "--compile.components", "loss"],
            "needs compile",
        ),
    ],
)
def test_bad_values_are_one_line(args, message):
    with pytest.raises(TitanError, match=re.escape(message)) as err:
        load_config(args)
    assert "\n" not in str(err.value)


def test_memory_budget_needs_compiled_blocks_and_matplotlib_for_its_curves(tmp_path, monkeypatch):
    monkeypatch.setattr(functorch_config, "activation_memory_budget", functorch_config.activation_memory_budget)
    with pytest.raises(TitanError, match="needs compile"):
        apply_ac(build(FOUR), "memory_budget")
    ac = ActivationCheckpoint(mode="memory_budget", memory_budget=0.25, visualize_memory_budget_pareto=True)
    # matplotlib hidden only around this call: undone before anything imports it for real, so no
    # half-registered matplotlib (its submodules without their parent) outlives the test.
    with monkeypatch.context() as hidden:
        hidden.setitem(sys.modules, "matplotlib", None)
        with pytest.raises(TitanError, match="visualize_memory_budget_pareto' needs matplotlib"):
            apply_ac(build(FOUR), ac, compiled=True, dump_folder=str(tmp_path))
    monkeypatch.setattr(functorch_config, "visualize_memory_budget_pareto", False)
    monkeypatch.setattr(functorch_config, "memory_budget_pareto_dir", None)
    assert apply_ac(build(FOUR), ac, compiled=True, dump_folder=str(tmp_path)) == []
    assert functorch_config.activation_memory_budget == 0.25
    assert functorch_config.memory_budget_pareto_dir == str(tmp_path / "memory_budget_pareto")
    apply_ac(build(FOUR), "none", compiled=True)  # a later compiled run without a budget gets torch's default
    assert functorch_config.activation_memory_budget == 1.0 and not functorch_config.visualize_memory_budget_pareto


def test_memory_estimate_places_a_budget_between_full_and_none(monkeypatch):
    from titan.training.memory import estimate_memory

    patch_flavors(monkeypatch, tiny=replace(TINY, vocab_size=2048))  # the shipped tokenizer's vocabulary
    base = ["--model.flavor", "tiny", "--training.seq_len", "32", "--training.local_batch_size", "4"]
    base += ["--training.mixed_precision_param", "float32"]

    def activations(*extra: str) -> float:
        return estimate_memory(load_config([*base, *extra]), 1).activation_bytes

    none, full = activations(), activations("--activation_checkpoint.mode", "full")
    budget = ("--compile.enable", "--activation_checkpoint.mode", "memory_budget")
    assert full < none
    assert activations(*budget, "--activation_checkpoint.memory_budget", "0.25") == full + 0.25 * (none - full)
