"""Continued pretraining from quantized release folders: the run builds the folder's model (its
config.json), loads it dequantized (checkpoint.initial_load_in_hf), and its first step's loss is
transformers' loss on the same batch with transformers' own dequantization. Kimi K2 (FP8, its
tiktoken tokenizer read from the folder) through ./run_train.sh as a user runs it; DeepSeek-V3 (FP8)
and gpt-oss (MXFP4) with the same flags in-process."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import hf_release as H
from tests.helpers.runs import REPO, run_env
from titan.config import load_config
from titan.training.trainer import Trainer

pytestmark = pytest.mark.slow

LOSS = re.compile(r"step:\s*1\s+loss:\s*([0-9.]+)")


def _flags(model: str, folder: Path, *extra: str) -> list[str]:
    return [
        "--model.name", model, "--model.flavor", "debugmodel",
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "1",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.disable_color_printing",
        "--checkpoint.enable", "--checkpoint.initial_load_path", str(folder),
        "--checkpoint.initial_load_in_hf", "--checkpoint.config_mismatch", "use_checkpoint", *extra,
    ]  # fmt: skip


def _trainer(flags: list[str], dump: Path) -> Trainer:
    """The run ./run_train.sh starts, in this process (its default config file first)."""
    config = REPO / "train_configs/debug_model.toml"
    return Trainer(load_config(["--job.config_file", str(config), *flags, "--job.dump_folder", str(dump)]))


def _transformers_loss(folder: Path, family: str, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    inputs, labels = batch[0]
    with torch.no_grad():
        logits = H.load_transformers(folder, family)(inputs).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100).item()


def _first_batch(trainer: Trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batch = trainer.next_microbatches()
    assert batch is not None
    return batch


def test_kimi_k2_fp8_first_loss_through_run_train_sh(tmp_path: Path) -> None:
    H.deepseek_release(tmp_path / "kimi", kimi=True)
    flags = _flags("deepseek_v3", tmp_path / "kimi", "--model.tokenizer_path", str(tmp_path / "kimi"))
    out = subprocess.run(
        ["./run_train.sh", *flags, "--job.dump_folder", str(tmp_path / "run")],
        cwd=REPO, env=run_env(NGPU="1"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "loaded Hugging Face weights" in text and "multi-token prediction" in text, text[-3000:]
    first = LOSS.search(text)
    assert first is not None, text[-3000:]
    # The same first batch from the same data pipeline (a trainer that only reads it).
    ref = _transformers_loss(tmp_path / "kimi", "deepseek_v3", _first_batch(_trainer(flags, tmp_path / "batch")))
    assert abs(float(first[1]) - ref) < 1e-4, (first[1], ref)  # the log prints 4 decimals


@pytest.mark.parametrize("release", ["deepseek_v3", "gpt_oss"])
def test_fp8_and_mxfp4_releases_train_from_transformers_first_loss(release: str, tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    (H.deepseek_release if release == "deepseek_v3" else H.gpt_oss_release)(folder)
    flags = _flags(release, folder)
    trainer = _trainer(flags, tmp_path / "run")
    batch = _first_batch(trainer)
    ref = _transformers_loss(folder, release, batch)
    loss, _ = trainer.train_step(batch)
    assert abs(loss.item() - ref) < 1e-4, (loss.item(), ref)
