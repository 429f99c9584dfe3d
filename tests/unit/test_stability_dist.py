"""Two FSDP2 ranks (gloo): non-finite decisions agree across ranks, validation reduces over dp,
the parameter norm covers all shards, and the process groups switch to the training timeout."""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[2]


def _rank(rank: int, world: int, dump: str) -> dict:
    from titan.config import load_config
    from titan.stability import param_norm
    from titan.trainer import Trainer

    config = load_config([
        "--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--job.dump_folder", dump,
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "3",
        "--training.dataset", "pydoc_train", "--training.nonfinite", "skip_step", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--validation.enable", "--validation.freq", "3",
        "--validation.steps", "2", "--comm.train_timeout_seconds", "42",
    ])
    trainer = Trainer(config)
    original = Trainer.train_step

    def train_step(self, microbatches):
        # NaN gradients on rank 1 only, at step 2: FSDP's reduce-scatter spreads them, so the
        # global grad norm is NaN on both ranks and both must skip the same step.
        handles = []
        if self.step == 2 and rank == 1:
            def poison(module, inputs, out):
                out.register_hook(lambda g: g * math.nan)
            handles.append(self.model_parts[0].register_forward_hook(poison))
        try:
            return original(self, microbatches)
        finally:
            for h in handles:
                h.remove()

    Trainer.train_step = train_step
    losses = trainer.train()
    params = [p.detach() for p in trainer.model_parts[0].parameters()]
    full = torch.cat([p.full_tensor().flatten() for p in params])
    cpu = torch.device("cpu")
    timeouts = [g._get_backend(cpu).options._timeout.total_seconds()
                for g in (dist.group.WORLD, trainer.parallel_dims.submesh("dp").get_group())]
    return {
        "losses": losses,
        "skipped": trainer.stability.skipped_steps,
        "validation": trainer.validator.history,
        "param_norm": param_norm(trainer.model_parts).item(),
        # float64: torch's CPU norm of one 5.7M-element fp32 tensor is off by ~0.1%
        "full_norm": full.double().norm().item(),
        "timeouts": timeouts,
    }


@pytest.mark.slow
def test_two_rank_nonfinite_validation_param_norm_timeouts(tmp_path):
    r0, r1 = run_distributed(_rank, 2, str(tmp_path))
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["losses"] == r1["losses"] and sorted(r0["losses"]) == [1, 2, 3]
    assert r0["validation"] == r1["validation"] and math.isfinite(r0["validation"][3])
    assert r0["param_norm"] == pytest.approx(r0["full_norm"], rel=1e-5)
    assert r0["param_norm"] == pytest.approx(r1["param_norm"], rel=1e-6)
    assert r0["timeouts"] == r1["timeouts"] == [42.0, 42.0]
