"""Launch scripts: syntax, shellcheck, and the dry run through run_train.sh as a user runs it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["run_train.sh", "multinode_trainer.slurm"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(script):
    out = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_clean():
    out = subprocess.run(["shellcheck", *SCRIPTS], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def _run_train_sh(*args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NGPU"}
    env.update(COMM_MODE="fake_backend", OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env_extra)
    out = subprocess.run(["./run_train.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_run_train_sh_fake_backend_dry_run_hsdp():
    out = _run_train_sh("--parallelism.data_parallel_replicate_degree", "2", NGPU="8")
    assert "dry run: llama3 debugmodel on 8 ranks" in out.stdout
    assert "mesh: DeviceMesh((dp_replicate=2, dp_shard=4)" in out.stdout
    assert "matches the model's" in out.stdout, out.stdout


@pytest.mark.slow
def test_run_train_sh_detects_the_gpu_count():
    import torch

    n = max(torch.cuda.device_count(), 1)  # a CPU-only machine runs 1 process
    out = _run_train_sh()
    assert f"dry run: llama3 debugmodel on {n} rank" in out.stdout, out.stdout
