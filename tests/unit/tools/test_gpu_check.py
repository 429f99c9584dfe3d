"""scripts/gpu_check.sh --dry: the GPU check's rehearsal on CPU keeps working (each of its steps
runs: the cuda tests' collection, a benchmark row, the profile table, the versions)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_dry_rehearsal_runs_every_step(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO)}
    # One benchmark row and one test file keep it cheap; the GPU run takes four rows and all tests.
    cmd = ["bash", "scripts/gpu_check.sh", "--dry", "--only", "eager", "--tests", "tests/cuda/test_nccl.py"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    steps = [line.split(":")[0] for line in summary]
    assert steps == ["install", "pytest", "bench-eager", "profile", "versions", "total"], summary
    assert all(": ok (" in line for line in summary[:-1]), summary
    assert "skipped" in (tmp_path / "pytest.log").read_text()  # collected, skipped without CUDA
    bench = (tmp_path / "bench.log").read_text()
    assert "| eager " in bench and "failed" not in bench, bench
    profile = (tmp_path / "profile.log").read_text()
    assert "Self CPU time total" in profile and "per step: wall" in profile, profile
    assert "torch " in (tmp_path / "versions.log").read_text()


def test_unknown_option_is_one_clear_line(tmp_path):
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--fast"],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gpu_check.sh: unknown option '--fast'; valid: --dry, --only ROWS, --tests PATH, --fetch-wheels"
    )
