"""The README's first command, `./run_train.sh` (debug model, train_configs/debug_model.toml, as
shipped), shows clear learning: the mean loss of its last 5 steps is at most 70% of its first 5; the
default spike detection stays quiet on this healthy run, it prints no warning at all (the epoch
boundary included), each step logs the lr it used, and TensorBoard gets the events."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from titan.config import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    config = load_config(["--job.config_file", str(REPO / "train_configs/debug_model.toml")])
    assert config.metrics.log_freq == 1 and config.metrics.enable_jsonl, "every step's loss must be logged"
    # Only the output folder moves (the run would otherwise write ./outputs in the repository).
    run = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(tmp_path)],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG_FILE")},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [jsonl] = (tmp_path / config.metrics.save_jsonl_folder).glob("*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows = [r for r in records if "loss_metrics/global_avg_loss" in r]  # the attempt's goodput has a record too
    assert any("goodput/attempt(%)" in r for r in records)
    assert config.metrics.enable_tensorboard and list(tmp_path.rglob("events.out.tfevents.*")), "no TensorBoard events"
    losses = [r["loss_metrics/global_avg_loss"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, config.training.steps + 1))
    assert "spike" not in run.stdout + run.stderr, [
        line for line in (run.stdout + run.stderr).splitlines() if "spike" in line
    ]
    assert rows[-1]["stability/grad_norm_spikes"] == rows[-1]["stability/loss_spikes"] == 0
    # about 1.2 passes over the corpus: the epoch boundary is expected, an INFO line, not a warning
    out = run.stdout + run.stderr
    assert "INFO - dataset 'pydoc' (dp rank 0, stream 0): read through its data; epoch 1 begins" in out, out[-3000:]
    # A healthy run warns about nothing (titan's WARNING lines, torch's C++ "Warning:" lines).
    assert not [line for line in out.splitlines() if "WARNING" in line or "Warning:" in line], out[-3000:]
    # Each step logs the lr it used: step 1 runs at 1/warmup of the peak, step warmup at the peak.
    peak, warmup = config.optimizer.lr, config.lr_scheduler.warmup_steps
    assert rows[0]["lr"] == pytest.approx(peak / warmup, rel=1e-12)
    assert rows[warmup - 1]["lr"] == pytest.approx(peak, rel=1e-12)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last <= 0.7 * first, (
        f"mean loss of the first 5 steps {first:.3f}, of the last 5 {last:.3f}"
        f" ({last / first:.1%} > 70%): {[round(x, 2) for x in losses]}"
    )
