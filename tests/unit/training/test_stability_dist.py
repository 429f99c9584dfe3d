"""Two gloo ranks, FSDP2 / tensor parallel / pipeline parallel: non-finite decisions agree across
ranks, validation reduces over dp, runs with loss parallel and through the pipeline schedule, the
parameter norm covers all shards and stages, and the process groups switch to the training
timeout."""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed

REPO = Path(__file__).resolve().parents[3]
LAYOUTS = {
    "fsdp2": (),
    "tp2": ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
    "pp2": (
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.pipeline_parallel_schedule",
        "GPipe",
    ),
}


def _rank(rank: int, world: int, dump: str, layout: tuple[str, ...]) -> dict:
    from titan.config import load_config
    from titan.training.stability import param_norm
    from titan.training.trainer import Trainer

    config = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            dump,
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "3",
            "--training.dataset",
            "pydoc_train",
            "--training.nonfinite",
            "skip_step",
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "false",
            "--validation.enable",
            "--validation.freq",
            "3",
            "--validation.steps",
            "2",
            "--comm.train_timeout_seconds",
            "42",
            *layout,
        ]
    )
    trainer = Trainer(config)
    original = Trainer.train_step

    def train_step(self, microbatches):
        # NaN gradients on the last rank only, at step 2: FSDP's reduce-scatter / the pp-summed
        # grad norm spread them, so every rank must skip the same step.
        handles = []
        if self.step == 2 and rank == world - 1:

            def poison(module, inputs, out):
                out.register_hook(lambda g: g * math.nan)

            handles.append(self.model_parts[-1].register_forward_hook(poison))
        try:
            return original(self, microbatches)
        finally:
            for h in handles:
                h.remove()

    Trainer.train_step = train_step
    try:
        losses = trainer.train()
    finally:
        Trainer.train_step = original
    params = [p.detach() for m in trainer.model_parts for p in m.parameters()]
    local_sq = sum(float((p.full_tensor() if hasattr(p, "full_tensor") else p).double().pow(2).sum()) for p in params)
    timeouts = []
    pp = trainer.parallel_dims.submesh("pp")
    if dist.is_initialized():
        cpu = torch.device("cpu")
        groups = [dist.group.WORLD] + [m.get_group() for m in (trainer.parallel_dims.submesh("dp"), pp) if m]
        timeouts = [g._get_backend(cpu).options._timeout.total_seconds() for g in groups]
    return {
        "losses": losses,
        "skipped": trainer.stability.skipped_steps,
        "validation": trainer.validator.history,
        "param_norm": param_norm(trainer.model_parts, pp.get_group() if pp else None).item(),
        "stage_sq": local_sq,  # this rank's stage(s), float64
        "timeouts": timeouts,
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return _rank(0, 1, str(tmp_path_factory.mktemp("ref")), ())


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_nonfinite_validation_param_norm_timeouts(tmp_path, layout, one_process):
    r0, r1 = run_distributed(_rank, 2, str(tmp_path), LAYOUTS[layout])
    assert r0["skipped"] == r1["skipped"] == one_process["skipped"] == 1
    assert r0["losses"] == r1["losses"] and sorted(r0["losses"]) == [1, 2, 3]
    assert r0["validation"] == r1["validation"] and math.isfinite(r0["validation"][3])
    assert r0["param_norm"] == pytest.approx(r1["param_norm"], rel=1e-6)
    assert r0["timeouts"] == r1["timeouts"] and set(r0["timeouts"]) == {42.0}
    # the stages' squared norms add up to the total the log reports
    total_sq = r0["stage_sq"] + r1["stage_sq"] if layout == "pp2" else r0["stage_sq"]
    assert r0["param_norm"] == pytest.approx(math.sqrt(total_sq), rel=1e-5)
    if layout != "fsdp2":
        # same data as one process (dp = 1): losses, validation and norms match it
        for step, loss in one_process["losses"].items():
            assert r0["losses"][step] == pytest.approx(loss, abs=1e-4)
        assert r0["validation"][3] == pytest.approx(one_process["validation"][3], abs=1e-4)
        assert r0["param_norm"] == pytest.approx(one_process["param_norm"], rel=1e-5)
