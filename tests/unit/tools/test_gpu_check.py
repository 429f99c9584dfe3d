"""scripts/gpu_check.sh --dry: the GPU check's rehearsal on CPU keeps working and passes (each of
its steps runs: the versions, every registered family's bf16 smoke run, the cuda tests' collection,
a benchmark row, the MoE row, the optimizer row, the profile table); what a CPU cannot run is
skipped with its reason, and a step that should run and fails fails the check."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


# The smoke step's machinery is one bench_row per family: the rehearsal runs a dense and a MoE family
# (the GPU run takes every family; each family trains on CPU in its own tests).
FAMILIES = ["llama3", "llama4"]
STEPS = ["install", "versions", *(f"smoke-{f}" for f in FAMILIES), "pytest", "bench", "moe", "gdn", "optim", "profile"]


def test_the_rehearsed_families_are_registered():
    from titan.models import model_names

    assert set(FAMILIES) <= set(model_names())


def test_dry_rehearsal_runs_every_step_and_passes(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO)}
    # Two benchmark rows (one that runs, flex that a CPU cannot train), two families and one test
    # file keep it cheap; the GPU run takes four rows, every family and all tests.
    cmd = ["bash", "scripts/gpu_check.sh", "--dry", "--only", "eager,flex", "--tests", "tests/cuda/test_nccl.py"]
    cmd += ["--steps", ",".join(STEPS)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    steps = [line.split(":")[0] for line in summary]
    smoke = [f"smoke-{f}" for f in FAMILIES]
    assert steps == ["install", "versions", *smoke, "pytest", "bench-eager", "bench-flex", "moe", "moe-deepseek_v3",
                     "moe-gpt_oss", "gdn", "optim", "profile", "total"], summary  # fmt: skip
    status = dict(line.split(": ", 1) for line in summary)
    for name in ["install", "versions", *smoke, "pytest", "bench-eager", "moe", "profile"]:
        assert re.fullmatch(r"ok \(\d+s\)", status[name]), summary  # each part says how long it took
    assert re.fullmatch(
        r"skipped: flex attention has no backward on CPU \(CPU rehearsal\) \(\d+s\)", status["bench-flex"]
    )
    gdn = r"skipped: fla's kernels need CUDA \(CPU rehearsal: the torch row ran\) \(\d+s\)"
    assert re.fullmatch(gdn, status["gdn"]), summary
    assert re.search(r"^\| torch .*\| [0-9.]+ +\|$", (tmp_path / "gdn.log").read_text(), re.M)
    for family in ("deepseek_v3", "gpt_oss"):  # their GPU shapes: said, not run, on CPU
        assert re.fullmatch(r"skipped: the \w+ shape does not fit a CPU rehearsal .*\(\d+s\)", status[f"moe-{family}"])
    from titan.training.optim import OPTIMIZERS

    if "muon" in {n.lower() for n in OPTIMIZERS}:
        assert status["optim"].startswith("ok ("), summary
    else:
        assert status["optim"].startswith("skipped: optimizer.name Muon is not registered"), summary
    assert "skipped" in (tmp_path / "pytest.log").read_text()  # collected, skipped without CUDA
    bench = (tmp_path / "bench.log").read_text()
    assert re.search(r"^\| eager .*\| [0-9.]+ +\| [0-9.]+ +\|$", bench, re.M), bench  # peak memory, loss
    smoke_log = (tmp_path / "smoke.log").read_text()
    for family in FAMILIES:  # each family's row: its peak memory and last loss
        assert re.search(rf"^\| {family} .*\| [0-9.]+ +\| [0-9.]+ +\|$", smoke_log, re.M), smoke_log
    assert "--training.mixed_precision_param bfloat16" in smoke_log
    assert re.search(r"^\| ep1 .*\| [0-9.]+ +\|$", (tmp_path / "moe.log").read_text(), re.M)
    profile = (tmp_path / "profile.log").read_text()
    assert "Self CPU time total" in profile and "per step: wall" in profile, profile
    assert "torch " in (tmp_path / "versions.log").read_text()


def test_a_step_that_should_run_and_fails_fails_the_rehearsal(tmp_path):
    # Not a CPU gap: the versions step with a Python that fails (PYTHON=false, no process started).
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO), "PYTHON": "false"}
    cmd = ["bash", "scripts/gpu_check.sh", "--dry", "--steps", "versions"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert re.fullmatch(r"versions: FAILED: exit 1 \(\d+s\)", summary[0]), summary
    assert [line.split(":")[0] for line in summary] == ["versions", "total"]


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
        "gpu_check.sh: unknown option '--fast'; valid: --dry, --only ROWS, --steps NAMES, --tests PATH, --fetch-wheels"
    )
