"""The start-up summary table (rank 0) and the merged config saved when a run starts."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from titan.config import load_config
from titan.training.startup import _memory_text, _peak_text
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
ROWS = (
    "device",
    "world size, layout",
    "model",
    "loss",
    "parameter memory",
    "FLOPs per token",
    "peak FLOP/s for MFU",
    "memory estimate",
)


def _trainer(tmp_path: Path, caplog, *extra: str) -> tuple[Trainer, str]:
    config = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(tmp_path),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--metrics.enable_tensorboard",
            "false",
            *extra,
        ]
    )
    with caplog.at_level(logging.INFO, logger="titan"):
        trainer = Trainer(config)
    [summary] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up summary")]
    return trainer, summary


def _row(summary: str, name: str) -> str:
    [line] = [line for line in summary.splitlines() if line.startswith(name + "  ")]
    return line[len(name) :].strip()


@pytest.mark.slow
def test_summary_rows_on_cpu(tmp_path, caplog):
    trainer, summary = _trainer(tmp_path, caplog)
    for name in ROWS:
        assert _row(summary, name), name
    assert _row(summary, "device") == f"1 x cpu ({os.cpu_count()} cores)"
    assert _row(summary, "world size, layout") == "1: dp_replicate 1, dp_shard 1, tp 1, pp 1, cp 1"
    assert _row(summary, "model") == f"llama3 debugmodel: {trainer.num_params:,} parameters"
    rows = trainer.model_parts[0].output.weight.shape[0]
    assert _row(summary, "loss") == f"full logits, {2 * 32} tokens per micro-batch ({rows:,} vocabulary rows)"
    assert _row(summary, "parameter memory").startswith(f"{trainer.num_params * 4 / 2**20:.1f} MiB in all (float32)")
    assert _row(summary, "FLOPs per token").startswith(f"{trainer.flops_per_token:,} ")
    assert _row(summary, "peak FLOP/s for MFU").startswith("n/a (no peak for CPUs in titan/training/flops.py")
    assert "% (titan/training/memory.py)" in _row(summary, "memory estimate")
    assert "host RAM" in _row(summary, "memory estimate")
    # Saved once the run is committed to start: loading it gives the run's config back.
    again = load_config(["--job.config_file", str(tmp_path / "config.toml")])
    assert again.training == trainer.config.training and again.optimizer == trainer.config.optimizer


def test_the_memory_row_can_be_turned_off():
    argv = ["--job.config_file", str(REPO / "train_configs/debug_model.toml")]
    config = load_config([*argv, "--metrics.startup_memory_estimate", "false"])
    text = _memory_text(config, 1, 1e9, "host RAM")
    assert text == "off (metrics.startup_memory_estimate = false; --job.dry_run estimates it)"


def test_the_memory_row_of_a_multi_rank_run_says_where_to_get_it(monkeypatch):
    # a rank of a torchrun world cannot start the fake world the estimate plays a rank in
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--job.config_file", str(REPO / "train_configs/debug_model.toml")]
    text = _memory_text(load_config(argv), 2, 1e9, "host RAM")
    assert text == (
        "n/a in a rank of a multi-rank run (--job.dry_run or scripts/estimate_memory.py estimate it in one process)"
    )


def test_peak_text_names_its_source():
    text = _peak_text(989e12, "NVIDIA H100 80GB HBM3", torch.device("cuda"), float8=False)
    assert (
        text == "989.0 TFLOP/s dense bf16 (titan/training/flops.py peak table, by device name 'NVIDIA H100 80GB HBM3')"
    )
    assert "float8" in _peak_text(1979e12, "NVIDIA H100 80GB HBM3", torch.device("cuda"), float8=True)
    assert _peak_text(None, "Some GPU", torch.device("cuda"), float8=False).startswith(
        "n/a ('Some GPU' is not in the titan/training/flops.py peak table"
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_summary_rows_on_gpu(tmp_path, caplog):
    _, summary = _trainer(tmp_path, caplog, "--training.mixed_precision_param", "bfloat16")
    name = torch.cuda.get_device_name(0)
    assert _row(summary, "device") == f"1 x {name}"
    assert "device memory" in _row(summary, "memory estimate")
    peak = _row(summary, "peak FLOP/s for MFU")
    assert peak.startswith("n/a") or f"by device name {name!r}" in peak
