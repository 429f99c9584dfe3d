"""optimizer.early_step_in_backward: per-parameter steps in backward train exactly as the ordinary
step (fp32, no clipping), free every gradient, resume exactly from a checkpoint, and are refused in
one line with what cannot run with them."""

import pytest

from tests.helpers.parity import FLAVORS, STEPS, reference
from tests.helpers.runs import signal_during
from tests.helpers.runs import trainer as tiny_trainer
from tests.helpers.tiny import patch_flavors
from titan.config import load_config
from titan.errors import TitanError
from titan.training.optim_in_backward import OptimizersInBackward
from titan.training.plan import plan_run

EARLY = ("--optimizer.early_step_in_backward", "true", "--training.max_norm", "0")


@pytest.mark.parametrize(
    ("world", "flags", "needles"),
    [
        (1, ("--optimizer.early_step_in_backward",), ["grad clipping (training.max_norm = 1.0; set it to 0)"]),
        (
            1,
            (*EARLY, "--training.local_batch_size", "2", "--training.global_batch_size", "4"),
            ["gradient accumulation"],
        ),
        (2, (*EARLY, "--parallelism.pipeline_parallel_degree", "2"), ["pipeline parallel"]),
        (2, (*EARLY, "--parallelism.data_parallel_replicate_degree", "2"), ["DDP"]),
        (1, (*EARLY, "--training.nonfinite", "skip_step"), ["training.nonfinite = skip_step"]),
        # Everything that clashes, in one line.
        (
            2,
            ("--optimizer.early_step_in_backward", "--parallelism.pipeline_parallel_degree", "2"),
            ["cannot run with grad clipping", "; pipeline parallel"],
        ),
        (1, ("--training.enable_cpu_offload",), ["training.enable_cpu_offload needs FSDP"]),
        (2, ("--training.enable_cpu_offload", "--parallelism.data_parallel_replicate_degree", "2"), ["needs FSDP"]),
        (
            2,
            (
                "--training.enable_cpu_offload",
                "--float8.enable_float8_linear",
                "--float8.emulate",
                "--float8.enable_fsdp_float8_all_gather",
            ),
            ["does not combine with float8.enable_fsdp_float8_all_gather"],
        ),
        (2, ("--training.enable_cpu_offload", "--training.nonfinite", "skip_step"), []),  # CPU ranks: host tensors only
        (2, (*EARLY, "--training.enable_cpu_offload"), []),  # FSDP over 2 ranks: both run, together too
        (1, EARLY, []),
    ],
)
def test_refused_in_one_line(world, flags, needles, device="cpu"):
    config = load_config(["--training.seq_len", "32", *flags])
    if not needles:
        plan_run(config, world, device)
        return
    with pytest.raises(TitanError) as info:
        plan_run(config, world, device)
    line = str(info.value)
    assert "\n" not in line and all(n in line for n in needles), line


def test_offload_with_skip_step_refused_on_gpus():
    test_refused_in_one_line(
        2,
        ("--training.enable_cpu_offload", "--training.nonfinite", "skip_step"),
        ["does not combine with training.nonfinite = skip_step on GPUs"],
        device="cuda",
    )


def test_step_in_backward_equals_the_ordinary_step(tmp_path, monkeypatch):
    """10 steps, fp32, one process, weight decay spared on norms (two param groups): the same losses
    within 1e-5 and the same grad norms; no gradient is left after a step."""
    patch_flavors(monkeypatch, **FLAVORS)
    flags = ("--training.max_norm", "0", "--optimizer.weight_decay_exclude", "norms")
    ordinary = reference(str(tmp_path / "ordinary"), *flags)
    early_trainer = []

    def keep(trainer):
        early_trainer.append(trainer)
        return trainer

    from tests.helpers import parity

    monkeypatch.setattr(parity, "run", lambda trainer, run=parity.run: run(keep(trainer)))
    early = parity.reference(str(tmp_path / "early"), *flags, "--optimizer.early_step_in_backward", "true")
    (trainer,) = early_trainer
    assert isinstance(trainer.optimizers, OptimizersInBackward)
    assert len(trainer.optimizers) == sum(1 for m in trainer.model_parts for _ in m.parameters())
    assert all(p.grad is None for m in trainer.model_parts for p in m.parameters())
    assert len(early) == len(ordinary) == STEPS
    for (loss, norm), (ref_loss, ref_norm) in zip(early, ordinary):
        assert abs(loss - ref_loss) < 1e-5, (early, ordinary)
        assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm), (early, ordinary)


@pytest.mark.slow
def test_resume_with_step_in_backward_is_exact(tmp_path):
    """Optimizer state (per-parameter optimizers, FQN-keyed as the ordinary container's) and the LR
    schedule come back from the checkpoint: steps 4-6 after a stop at step 3 equal the uninterrupted run."""
    flags = (*EARLY, "--checkpoint.enable", "--checkpoint.interval", "100", "--lr_scheduler.warmup_steps", "2")
    uninterrupted = tiny_trainer(tmp_path / "whole", *flags).train()
    first = tiny_trainer(tmp_path / "stopped", *flags)
    signal_during(first, 3, send=True)
    before = first.train()
    assert sorted(before) == [1, 2, 3] and (tmp_path / "stopped/checkpoint/step-3").is_dir()
    resumed = tiny_trainer(tmp_path / "stopped", *flags)
    assert resumed.step == 3
    after = resumed.train()
    assert sorted(after) == [4, 5, 6]
    assert {**before, **after} == pytest.approx(uninterrupted, abs=1e-6)
