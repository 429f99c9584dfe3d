"""Float8 (torchao): which Linears convert, config errors, and training close to high precision."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torchao.float8.float8_linear import Float8Linear

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import TINY, batch, build, train_losses
from titan.config import load_config
from titan.config.job_config import Float8 as Float8Config
from titan.errors import TitanError
from titan.parallel.float8 import build_precompute_hook, check_float8_hardware, convert_to_float8
from titan.training.checks import load_job

REPO = Path(__file__).resolve().parents[3]
TINY_2K = replace(TINY, vocab_size=2048)  # the shipped tokenizer's vocabulary, for the Trainer


def _linears(model: nn.Module) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_converts_all_but_filtered_and_odd_sized_linears():
    # vocab 120: the output projection is 64 x 120, and 120 is not a multiple of 16.
    model = build(replace(TINY, vocab_size=120))
    cfg = Float8Config(enable_float8_linear=True, emulate=True, filter_fqns=["feed_forward.w2"])
    converted = convert_to_float8(model, cfg, fsdp_enabled=False)
    kinds = _linears(model)
    kept = {"output", "layers.0.feed_forward.w2", "layers.1.feed_forward.w2"}
    assert set(converted) == set(kinds) - kept
    for name, kind in kinds.items():
        assert (kind is Float8Linear) == (name not in kept), name
    assert all(model.get_submodule(n).config.emulate for n in converted)
    assert not any(model.get_submodule(n).config.enable_fsdp_float8_all_gather for n in converted)


def test_disabled_is_a_no_op_and_default_filter_keeps_output():
    model = build()
    assert convert_to_float8(model, Float8Config(), fsdp_enabled=False) == []
    assert all(kind is nn.Linear for kind in _linears(model).values())
    converted = convert_to_float8(model, Float8Config(enable_float8_linear=True), fsdp_enabled=False)
    assert "output" not in converted and len(converted) == 7 * TINY.n_layers


def test_precompute_hook_only_with_fsdp_float8_all_gather():
    full = Float8Config(
        enable_float8_linear=True, enable_fsdp_float8_all_gather=True, precompute_float8_dynamic_scale_for_fsdp=True
    )
    assert callable(build_precompute_hook([build()], full, fsdp_enabled=True))
    assert build_precompute_hook([build()], full, fsdp_enabled=False) is None
    assert build_precompute_hook([build()], replace(full, precompute_float8_dynamic_scale_for_fsdp=False), True) is None


@pytest.mark.parametrize(
    "args, match",
    [
        (["--float8.recipe", "blockwise"], "float8.recipe"),
        (
            ["--float8.recipe", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
            "only with float8.recipe = tensorwise",
        ),
        (["--float8.precompute_float8_dynamic_scale_for_fsdp"], "needs float8.enable_fsdp_float8_all_gather"),
    ],
)
def test_bad_combinations_fail_at_config_load(args, match):
    with pytest.raises(TitanError, match=match):
        load_job(["--float8.enable_float8_linear", *args])


def test_old_gpu_without_emulate_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cfg = Float8Config(enable_float8_linear=True)
    with pytest.raises(TitanError, match="compute capability >= 8.9.*float8.emulate"):
        check_float8_hardware(cfg, torch.device("cuda", 0))
    check_float8_hardware(replace(cfg, emulate=True), torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_hardware(cfg, torch.device("cuda", 0))
    check_float8_hardware(cfg, torch.device("cpu"))


def test_rowwise_recipe_converts_with_axiswise_scales():
    from torchao.float8.config import ScalingGranularity

    model = build()
    convert_to_float8(
        model, Float8Config(enable_float8_linear=True, recipe="rowwise", emulate=True), fsdp_enabled=False
    )
    lin = model.layers["0"].attention.wq
    assert isinstance(lin, Float8Linear)
    assert lin.config.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE


@pytest.fixture(scope="module")
def high_precision_curve():
    return train_losses(build(), 30)


# 30 AdamW steps memorising one batch (the loss must fall); the real-kernel variant
# (torch._scaled_mm has a CPU reference kernel) gets 3 steps.
@pytest.mark.parametrize("emulate, steps", [(True, 30), (False, 3)], ids=["emulate", "cpu_scaled_mm"])
def test_float8_training_tracks_high_precision(high_precision_curve, emulate, steps):
    ref = high_precision_curve[:steps]
    model = build()
    convert_to_float8(model, Float8Config(enable_float8_linear=True, emulate=emulate), fsdp_enabled=False)
    got = train_losses(model, steps)
    rel = [abs(a - b) / b for a, b in zip(got, ref)]
    assert max(rel) < 0.03, rel
    assert got != ref  # float8 rounding really happened
    if steps > 10:
        assert ref[-1] < 0.8 * ref[0]  # the curve moves, so tracking it means something


def _batch_steps(trainer, rows: slice, steps: int = 3) -> list[float]:
    inputs, labels = batch(TINY_2K, bsz=4)
    return [trainer.train_step([(inputs[rows], labels[rows])])[0].item() for _ in range(steps)]


def _fsdp_float8_rank(rank: int, world: int, dump: str) -> dict:
    from tests.helpers.tiny import extra_flavors

    with extra_flavors(tiny=TINY_2K):
        return _fsdp_float8_checks(rank, dump)


def _fsdp_float8_checks(rank: int, dump: str) -> dict:
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from titan.training.trainer import Trainer

    trainer = Trainer(
        _trainer_config(
            dump, "--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"
        )
    )
    wq = trainer.model_parts[0].layers["0"].attention.wq
    local = wq.weight._local_tensor if isinstance(wq.weight, DTensor) else wq.weight
    checks = {
        "float8_linear": isinstance(wq, Float8Linear),
        "sharded": isinstance(wq.weight, DTensor),
        "float8_all_gather_weight": isinstance(local, WeightWithDynamicFloat8CastTensor),
        # the precompute hook; QK-clip's (the max-logit metric) is always registered beside it
        "hooks": sum(getattr(h, "__self__", None) is not trainer.qk_clip for h in trainer.optimizers._post_step_hooks),
        "scale_before": getattr(local, "_precomputed_scale", None) is not None,
    }
    losses = _batch_steps(trainer, slice(2 * rank, 2 * rank + 2))
    checks["scale_after"] = getattr(wq.weight._local_tensor, "_precomputed_scale", None) is not None
    return {"checks": checks, "losses": losses}


def _trainer_config(dump: str, *extra: str):
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            dump,
            "--model.flavor",
            "tiny",
            "--training.seq_len",
            "32",
            "--metrics.enable_tensorboard",
            "false",
            "--float8.enable_float8_linear",
            "--float8.emulate",
            *extra,
        ]
    )


@pytest.mark.slow
def test_fsdp2_float8_all_gather_with_precomputed_scales_matches_one_process(tmp_path, monkeypatch):
    """2 gloo ranks, FSDP2 + float8 all-gather + precomputed scales (emulated matmuls) against
    one process with plain float8 layers: tensorwise scales of the full weight either way."""
    from tests.helpers.tiny import patch_flavors
    from titan.training.trainer import Trainer

    patch_flavors(monkeypatch, tiny=TINY_2K)
    ref = _batch_steps(Trainer(_trainer_config(str(tmp_path / "ref"))), slice(0, 4))
    results = run_distributed(_fsdp_float8_rank, 2, str(tmp_path / "fsdp"))
    for r in results:
        assert r["checks"] == {
            "float8_linear": True,
            "sharded": True,
            "float8_all_gather_weight": True,
            "hooks": 1,
            "scale_before": False,
            "scale_after": True,
        }
        assert max(abs(a - b) for a, b in zip(r["losses"], ref)) < 1e-4, (r["losses"], ref)


def test_float8_with_activation_checkpointing_gives_identical_grads():
    from tests.helpers.tiny import batch
    from titan.parallel.ac import apply_ac
    from titan.parallel.init import canonical_fqn
    from titan.training.loss import cross_entropy_sum

    results = []
    for mode in ("none", "selective", "full"):
        model = build()
        convert_to_float8(model, Float8Config(enable_float8_linear=True, emulate=True), fsdp_enabled=False)
        apply_ac(model, mode, "op")
        inputs, labels = batch()
        cross_entropy_sum(model(inputs), labels).backward()
        results.append({canonical_fqn(n): p.grad for n, p in model.named_parameters()})
    for grads in results[1:]:
        for name, g in results[0].items():
            torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)
