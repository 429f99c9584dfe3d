"""bf16 parameters + torchao's stochastic-rounding AdamW track fp32 AdamW on the debug model."""

from pathlib import Path

import pytest
import torch

from titan.config import load_config
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
STEPS = 50


def _losses(dump: Path, *extra: str) -> tuple[dict[int, float], Trainer]:
    config = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(dump),
            # bf16 matmuls are slow on CPUs without AMX: tiny batches keep 50 steps affordable.
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            str(STEPS),
            "--lr_scheduler.warmup_steps",
            "5",
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.enable_jsonl",
            "false",
            *extra,
        ]
    )
    trainer = Trainer(config)
    return trainer.train(), trainer


@pytest.mark.slow
def test_bf16_stochastic_rounding_tracks_fp32_adamw(tmp_path):
    fp32, _ = _losses(tmp_path / "fp32")
    bf16, trainer = _losses(tmp_path / "bf16", "--optimizer.bf16_stochastic_round")
    assert {p.dtype for p in trainer.model_parts[0].parameters()} == {torch.bfloat16}
    tail = range(STEPS - 9, STEPS + 1)
    end_fp32 = sum(fp32[s] for s in tail) / len(tail)
    end_bf16 = sum(bf16[s] for s in tail) / len(tail)
    print(
        f"loss step 1: fp32 {fp32[1]:.4f} bf16-SR {bf16[1]:.4f}; mean of steps {tail.start}-{STEPS}:"
        f" fp32 {end_fp32:.4f} bf16-SR {end_bf16:.4f} ({100 * (end_bf16 / end_fp32 - 1):+.2f}%)"
    )
    assert end_fp32 < fp32[1] - 1.0  # it did train
    assert abs(end_bf16 / end_fp32 - 1) < 0.03, (end_fp32, end_bf16)
