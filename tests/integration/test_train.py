"""train.py / run_train.sh run as a user runs them, in subprocesses (1 and 2 ranks, gloo on CPU)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import cpu_env

REPO = Path(__file__).resolve().parents[2]
STEP_RE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+grad_norm:\s*([0-9.]+)")
# Small enough for 2 CPU cores, same debug model.
FAST = ["--training.seq_len", "128", "--training.local_batch_size", "4", "--metrics.disable_color_printing"]

pytestmark = pytest.mark.slow


def run(cmd: list[str], **env_extra: str) -> dict[int, tuple[float, float]]:
    env = cpu_env(**env_extra)
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    steps = {int(m[1]): (float(m[2]), float(m[3])) for m in STEP_RE.finditer(text)}
    assert steps, text[-4000:]
    return steps


def train_py(tmp_path: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "train.py",
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(tmp_path),
        *FAST,
        *args,
    ]


def torchrun(tmp_path: Path, nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "localhost:0",
        *train_py(tmp_path, *args)[1:],
    ]


def test_run_train_sh_two_ranks_loss_falls(tmp_path):
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), *FAST, "--training.steps", "30"]
    steps = run(cmd, NGPU="2")
    assert sorted(steps) == list(range(1, 31))
    assert sum(steps[s][0] for s in range(26, 31)) / 5 < steps[1][0] - 1.0


def test_fsdp_and_ddp_same_losses(tmp_path):
    fsdp = run(torchrun(tmp_path / "fsdp", 2, "--training.steps", "10"))
    ddp = run(
        torchrun(
            tmp_path / "ddp",
            2,
            "--training.steps",
            "10",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        )
    )
    assert sorted(fsdp) == sorted(ddp) == list(range(1, 11))
    for step in fsdp:
        assert abs(fsdp[step][0] - ddp[step][0]) < 1e-4, (step, fsdp[step], ddp[step])
        assert abs(fsdp[step][1] - ddp[step][1]) < 1e-3, (step, fsdp[step], ddp[step])


def test_bad_degrees_fail_fast_with_one_line(tmp_path):
    env = cpu_env()
    cmd = torchrun(tmp_path, 2, "--parallelism.data_parallel_shard_degree", "3")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    # rank 0's own line; plain torchrun then quotes it in its failure summary (run_train.sh's
    # launcher prints only the line: tests/integration/test_launchers.py)
    lines = [line for line in out.stderr.splitlines() if line.startswith("titan: error")]
    assert len(lines) == 1 and "world size is 2" in lines[0], out.stderr[-3000:]
    # torchrun reports the failed child with its own traceback; titan's code adds none.
    assert "titan/" not in out.stderr and 'train.py", line' not in out.stderr


def test_finite_dataset_stops_cleanly(tmp_path):
    data = tmp_path / "tiny.jsonl"
    data.write_text("\n".join('{"text": "%s"}' % ("word " * 200) for _ in range(3)) + "\n")
    steps = run(
        train_py(
            tmp_path,
            "--training.dataset_path",
            str(data),
            "--training.dataset_infinite",
            "false",
            "--training.steps",
            "50",
        )
    )
    assert 1 <= max(steps) < 50
