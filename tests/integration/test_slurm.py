"""multinode_trainer.slurm on a real one-node Slurm (scripts/slurm_local.sh up, brought down at the
end whatever happened): a run to the end, preemption by USR1 (requeue from the script), an
external `scontrol requeue` (SIGTERM), a config error, and REPLICA_GROUPS (two torchft replica
groups sharing the node; a group count that does not fit it). CPU ranks over gloo, tiny model; the
script is submitted unchanged with the command-line overrides its header documents."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.debug_kill import kill_env

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
TINY = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.interval",
    "100",
    "--training.steps",
    str(STEPS),
]
# rank 0's step lines (rank 1 logs as "[titan] [rank 1] ...")
STEP_RE = re.compile(r"^\[titan\] [0-9-]+ [0-9:,]+ - INFO - step:\s*(\d+)\s+loss:\s*([0-9.]+)", re.M)
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")

pytestmark = pytest.mark.slow


def _sh(*cmd: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"{cmd}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
    return out


@pytest.fixture(scope="session")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (scripts/slurm_local.sh installs and starts the daemons)")
    if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
        pytest.skip("Slurm is not installed and apt-get is missing to install it")
    try:
        up = _sh("bash", "scripts/slurm_local.sh", "up", check=False)
        if up.returncode != 0 and shutil.which("sbatch") is None:
            pytest.skip(f"the Slurm packages could not be installed: {up.stderr.strip().splitlines()[:1]}")
        assert up.returncode == 0, up.stdout + up.stderr
        yield
    finally:
        _sh("bash", "scripts/slurm_local.sh", "down", check=False, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _submit(tmp: Path, *args: str, err: str = "job.out", **env: str) -> str:
    """sbatch the script as a user of a CPU node would: overrides on the command line only.
    Output and error go to one file (job.out) unless ``err`` names another, so the lines of the run
    before a requeue and after it are in order."""
    environ = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        CONFIG_FILE="train_configs/debug_model.toml",
        GPUS_PER_NODE="2",
        RDZV_PORT=str(_free_port()),
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="25",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
        **env,
    )  # CPU ranks, as on a node without GPUs
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--cpus-per-task",
        "2",
        "--chdir",
        str(REPO),
        "--output",
        str(tmp / "job.out"),
        "--error",
        str(tmp / err),
        "multinode_trainer.slurm",
        *args,
        "--job.dump_folder",
        str(tmp / "run"),
    ]
    out = subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _job(job: str) -> dict[str, str]:
    text = _sh("scontrol", "show", "job", job).stdout
    return {m[1]: m[2] for m in re.finditer(r"(\w+)=(\S*)", text)}


def _wait(job: str, tmp: Path, timeout: float = 240) -> dict[str, str]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        info = _job(job)
        if info["JobState"] in FINAL:
            return info
        time.sleep(1)
    _sh("scancel", job, check=False)
    pytest.fail(f"job {job} not done in {timeout} s: {info}\n{_log(tmp)[-3000:]}")


def _log(tmp: Path) -> str:
    return "".join(p.read_text() for p in sorted(tmp.glob("job.*")))


def _wait_for_step(tmp: Path, step: int, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (tmp / "job.out").exists() and any(
            int(s) >= step for s, _ in STEP_RE.findall((tmp / "job.out").read_text())
        ):
            return
        time.sleep(0.5)
    pytest.fail(f"no step {step} in {timeout} s:\n{_log(tmp)[-3000:]}")


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory) -> dict[str, Any]:
    """An uninterrupted run: the first test's subject and the others' losses to match."""
    tmp = tmp_path_factory.mktemp("reference")
    info = _wait(_submit(tmp, *TINY), tmp)
    log = _log(tmp)
    return {"info": info, "log": log, "losses": {int(s): v for s, v in STEP_RE.findall(log)}}


def test_sbatch_trains_to_the_end(reference):
    assert reference["info"]["JobState"] == "COMPLETED", reference["log"][-3000:]
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1)), reference["log"][-3000:]
    assert "head node: " in reference["log"] and "1 x 2 ranks, restart 0" in reference["log"]
    assert "in-job restarts up to 3" in reference["log"], reference["log"][-3000:]


def test_a_killed_rank_is_restarted_inside_the_job(reference, tmp_path):
    """MAX_RESTARTS (3 by default) reaches the launcher: rank 1 killed once, the job goes on
    without a requeue and ends with the reference's losses."""
    job = _submit(tmp_path, *TINY, "--checkpoint.interval", "2", **kill_env("step=5@rank1@attempt0"))
    info = _wait(job, tmp_path)
    log = _log(tmp_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", f"{info}\n{log[-3000:]}"
    assert "restarting the ranks (restart 1 of 3)" in log, log[-3000:]
    losses = STEP_RE.findall(log)
    assert [int(s) for s, _ in losses] == [1, 2, 3, 4, 5, *range(5, STEPS + 1)], log[-3000:]
    assert all(reference["losses"][int(s)] == v for s, v in losses)


def _interrupt_and_resume(tmp: Path, reference: dict, interrupt: list[str]) -> str:
    # the ranks hold after step 3 until the signal reaches them: the job cannot end before it
    job = _submit(tmp, *TINY, **kill_env("hold:step=3"))
    _wait_for_step(tmp, 3)
    _sh(*interrupt, job)
    info = _wait(job, tmp)
    log = _log(tmp)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{log[-3000:]}"
    first, _, second = log.partition("restart 1")
    assert second, log[-3000:]
    saved = re.findall(r"checkpoint step (\d+) saved after a signal", first)
    assert len(saved) == 2 and len(set(saved)) == 1, first[-3000:]  # every rank, the same step
    step = int(saved[0])
    assert f"resumed from {tmp / 'run' / 'checkpoint' / f'step-{step}'}: step {step}" in second, second[-3000:]
    resumed = {int(s): v for s, v in STEP_RE.findall(second)}
    assert sorted(resumed) == list(range(step + 1, STEPS + 1)), second[-3000:]
    assert resumed == {s: reference["losses"][s] for s in resumed}
    return log


def test_usr1_preemption_saves_requeues_and_resumes_exactly(reference, tmp_path):
    log = _interrupt_and_resume(tmp_path, reference, ["scancel", "--signal=USR1", "--batch"])
    assert "requeueing job" in log


def test_external_requeue_sigterm_saves_and_resumes(reference, tmp_path):
    log = _interrupt_and_resume(tmp_path, reference, ["scontrol", "requeue"])
    assert "received SIGTERM" in log


@pytest.mark.parametrize("where", ["config", "ranks"])
def test_user_error_fails_the_job_with_titans_line_last(slurm, tmp_path, where):
    """A bad key and a missing dataset are both caught by the script's check before srun (it reads
    the files the config names); either way titan's line is the error file's last line."""
    if where == "config":
        args, line = (
            ["--training.stepz", "3"],
            "titan: error: unknown config key 'training.stepz'; did you mean 'training.steps'?",
        )
    else:
        missing = tmp_path / "missing"
        args, line = (
            ["--training.dataset_path", str(missing)],
            f"titan: error: dataset path '{missing}' does not exist (training.dataset_path)",
        )
    info = _wait(_submit(tmp_path, *args, err="job.err"), tmp_path, timeout=180)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    err = (tmp_path / "job.err").read_text().strip().splitlines()
    assert err[-1] == line, err[-10:]
    assert "Traceback" not in "\n".join(err) and "restarting the ranks" not in _log(tmp_path)


# a group's rank-0 step lines, prefixed by its launcher: "[replica1_rank0]:[titan] ... step: 3 ..."
REPLICA_STEP_RE = re.compile(r"^\[replica(\d+)_rank0\]:\[titan\] [0-9-]+ [0-9:,]+ - INFO - step:\s*(\d+)\s", re.M)


def test_replica_groups_share_the_node_and_each_trains_to_the_end(slurm, tmp_path):
    """REPLICA_GROUPS=2 on one node of GPUS_PER_NODE=2: a lighthouse and two groups of one CPU rank,
    each with its own rendezvous and its own folder under job.dump_folder."""
    pytest.importorskip("torchft")
    steps = 4
    env = {"REPLICA_GROUPS": "2", "LIGHTHOUSE_PORT": str(_free_port())}
    info = _wait(_submit(tmp_path, *TINY, "--training.steps", str(steps), **env), tmp_path)
    log = _log(tmp_path)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log[-3000:]}"
    assert "replica groups: 2 on 1 node(s), each 1 node(s) x 1 ranks" in log, log[-3000:]
    for group in range(2):
        assert f"replica group {group} of 2 joined the lighthouse" in log, log[-3000:]
        done = sorted(int(s) for g, s in REPLICA_STEP_RE.findall(log) if int(g) == group)
        assert done == list(range(1, steps + 1)), log[-3000:]
        assert (tmp_path / "run" / f"replica_{group}" / "checkpoint" / f"step-{steps}").is_dir()
    assert not list((REPO / "logs").glob(f".launch-summary-{info['JobId']}.*"))


def test_replica_groups_that_do_not_divide_the_node_fail_with_one_line(slurm, tmp_path):
    info = _wait(_submit(tmp_path, *TINY, err="job.err", REPLICA_GROUPS="3"), tmp_path, timeout=60)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    line = "REPLICA_GROUPS=3 on 1 node(s) puts 3 groups on each node, which does not divide its GPUS_PER_NODE=2 ranks"
    assert (tmp_path / "job.err").read_text() == f"titan: error: {line}\n"
    assert (tmp_path / "job.out").read_text() == "" and not (tmp_path / "run").exists()  # nothing started
