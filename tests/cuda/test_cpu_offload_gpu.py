"""training.enable_cpu_offload on GPUs: between steps the sharded parameters and the optimizer
states are host tensors (pinned), and the losses equal the run without offload (2 GPUs, FSDP 2)."""

import pytest
import torch

from tests.cuda._common import gpu_config
from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.cuda


def _offload_vs_plain(rank: int, world: int, dump: str) -> dict:
    from titan.training.trainer import Trainer

    out = {}
    for name, extra in (
        ("plain", ()),
        ("offload", ("--training.enable_cpu_offload", "true")),
        (
            "offload_early",
            (
                "--training.enable_cpu_offload",
                "true",
                "--training.max_norm",
                "0",
                "--optimizer.early_step_in_backward",
                "true",
            ),
        ),
        ("early", ("--training.max_norm", "0", "--optimizer.early_step_in_backward", "true")),
    ):
        trainer = Trainer(
            gpu_config(
                f"{dump}/{name}",
                "--training.steps",
                "5",
                "--training.mixed_precision_param",
                "float32",
                "--parallelism.data_parallel_shard_degree",
                "2",
                *extra,
            )
        )
        losses = trainer.train()
        params = [p for m in trainer.model_parts for p in m.parameters()]
        states = [
            t
            for o in trainer.optimizers
            for s in o.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ]
        out[name] = {
            "losses": [losses[s] for s in sorted(losses)],
            "param_devices": {p.to_local().device.type for p in params},
            "pinned": all(p.to_local().is_pinned() for p in params),
            "state_devices": {t.device.type for t in states},
        }
        del trainer
        torch.cuda.empty_cache()
    return out


def test_offloaded_states_live_on_the_host_and_train_the_same(tmp_path):
    for r in run_distributed(_offload_vs_plain, 2, str(tmp_path), backend="nccl", timeout=600):
        assert r["plain"]["param_devices"] == r["plain"]["state_devices"] == r["early"]["param_devices"] == {"cuda"}
        for name in ("offload", "offload_early"):
            assert r[name]["param_devices"] == r[name]["state_devices"] == {"cpu"} and r[name]["pinned"], r[name]
        assert r["offload"]["losses"] == pytest.approx(r["plain"]["losses"], rel=1e-4)
        assert r["offload_early"]["losses"] == pytest.approx(r["early"]["losses"], rel=1e-4)
        assert r["early"]["losses"][0] == pytest.approx(r["plain"]["losses"][0], rel=1e-5)  # the same first step
