"""Shared set-up of the GPU tests: the debug model on cuda:0, a few steps, losses and metric rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan.config import load_config
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def gpu_config(dump: Path, *extra: str):
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(dump),
            "--training.seq_len",
            "256",
            "--training.local_batch_size",
            "8",
            "--metrics.log_freq",
            "1",
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.disable_color_printing",
            *extra,
        ]
    )


def train(dump: Path, steps: int, *extra: str) -> tuple[list[float], Trainer]:
    """Losses of steps 1..steps (every step logged) and the trainer (on cuda:0)."""
    trainer = Trainer(gpu_config(dump, "--training.steps", str(steps), *extra))
    assert trainer.device == torch.device("cuda", 0)
    losses = trainer.train()
    assert sorted(losses) == list(range(1, steps + 1))
    return [losses[s] for s in range(1, steps + 1)], trainer


def metric_rows(dump: Path) -> dict[int, dict]:
    [jsonl] = (dump / "metrics").glob("*.jsonl")
    return {r["step"]: r for r in map(json.loads, jsonl.read_text().splitlines()) if "grad_norm" in r}


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def needs_capability(major: int, minor: int, what: str) -> None:
    have = torch.cuda.get_device_capability()
    if have < (major, minor):
        pytest.skip(f"{what} needs compute capability >= {major}.{minor}; this GPU has {have[0]}.{have[1]}")
