"""Launch scripts: syntax, shellcheck, the dry run through run_train.sh as a user runs it, user errors
(one line, exit 2, no torchrun traceback), signals to the launcher (save, exit 0, resume, no restart),
kill -9 of the launcher (the ranks stop), and restarts inside the job (MAX_RESTARTS): a killed rank
is restarted and the run ends with the uninterrupted losses and goodput records that add up; a
titan error is not restarted; a spent budget ends with the last cause."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.debug_kill import kill_env, wait_gone

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["run_train.sh", "multinode_trainer.slurm", "scripts/slurm_local.sh"]


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
    env.update(
        COMM_MODE="fake_backend",
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **env_extra,
    )
    out = subprocess.run(["./run_train.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _run_train_sh_argv(tmp_path: Path, *args: str, **env_extra: str) -> list[str]:
    """The command run_train.sh execs, read by a `python` on PATH that only writes down its arguments."""
    shim = tmp_path / "bin" / "python"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGV_FILE"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("COMM_MODE", "LOG_RANK", "MAX_RESTARTS", "CONFIG_FILE")}
    env.update(PATH=f"{shim.parent}:{os.environ['PATH']}", ARGV_FILE=str(tmp_path / "argv"), NGPU="2", **env_extra)
    out = subprocess.run(["./run_train.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return (tmp_path / "argv").read_text().splitlines()


def test_run_train_sh_hands_its_variables_to_the_launcher(tmp_path):
    argv = _run_train_sh_argv(tmp_path, "--training.steps", "5")
    assert argv[:2] == ["-m", "titan.launch"] and "--nproc_per_node=2" in argv
    flags = dict(zip(argv, argv[1:]))
    assert flags["--local-ranks-filter"] == "0" and flags["--max-restarts"] == "0", argv
    assert argv[argv.index("train.py") :] == [
        "train.py",
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--training.steps",
        "5",
    ]
    argv = _run_train_sh_argv(tmp_path, LOG_RANK="0,1", MAX_RESTARTS="3", CONFIG_FILE="train_configs/x.toml")
    flags = dict(zip(argv, argv[1:]))
    assert flags["--local-ranks-filter"] == "0,1" and flags["--max-restarts"] == "3", argv
    assert argv[argv.index("train.py") :] == ["train.py", "--job.config_file", "train_configs/x.toml"]
    # the dry run needs no launcher: one process stands in for NGPU ranks
    assert _run_train_sh_argv(tmp_path, "--training.steps", "5", COMM_MODE="fake_backend") == [
        "train.py",
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dry_run",
        "--job.dry_run_world_size",
        "2",
        "--training.steps",
        "5",
    ]


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


# ---------------------------------------------------------------- user errors through the launcher
def _launch(*args: str, **env_extra: str) -> subprocess.Popen:
    """run_train.sh as a user starts it from a shell: its own process group, like a terminal job."""
    # CPU ranks over gloo even on a GPU machine (2 ranks on one GPU would be refused by NCCL)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **env_extra,
    )
    env.pop("COMM_MODE", None)
    return subprocess.Popen(
        ["./run_train.sh", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    "args, line",
    [
        (["--job.config_file", "nope.toml"], "titan: error: config file 'nope.toml' does not exist"),
        (
            ["--training.stepz", "3"],
            "titan: error: unknown config key 'training.stepz'; did you mean 'training.steps'?",
        ),
    ],
)
def test_config_error_through_run_train_sh_is_one_line_exit_2(args, line):
    proc = _launch(*args, NGPU="2")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2, out[-3000:]
    assert out.strip().splitlines() == [out.strip().splitlines()[-1]] and out.strip().startswith(line), out[-3000:]


@pytest.mark.slow
def test_error_inside_the_ranks_ends_with_titans_line_not_torchruns_traceback(tmp_path):
    proc = _launch("--training.dataset_path", str(tmp_path / "missing"), "--job.dump_folder", str(tmp_path), NGPU="2")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last == f"titan: error: dataset path '{tmp_path / 'missing'}' does not exist (training.dataset_path)", out
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]


# ---------------------------------------------------------------- signals to the launcher
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
    "--checkpoint.enable",
    "--checkpoint.interval",
    "1000",
]


def _until_step(proc: subprocess.Popen, step: int) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(rf"step:\s*{step}\s+loss", line):
            return lines
    pytest.fail("".join(lines)[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_signal_to_run_train_sh_saves_exits_0_and_resumes(sig, tmp_path):
    # with restarts on: a signal is a request to stop, never a failure to restart from; the ranks
    # hold after step 3 until the signal reaches them, so the run cannot end before it
    proc = _launch(
        *TINY,
        "--training.steps",
        "10",
        "--job.dump_folder",
        str(tmp_path),
        NGPU="2",
        MAX_RESTARTS="2",
        **kill_env("hold:step=3"),
    )
    try:
        lines = _until_step(proc, 3)
        proc.send_signal(sig)
        out = "".join(lines) + proc.communicate(timeout=200)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    saved = re.findall(r"checkpoint step (\d+) saved after a signal", out)
    assert saved and (tmp_path / "checkpoint" / f"step-{saved[0]}").is_dir(), out[-3000:]
    assert f"received {sig.name}" in out and "Traceback" not in out and "restarting" not in out, out[-3000:]
    if sig == signal.SIGUSR1:  # and the next launch resumes from it
        step = int(saved[0])
        proc = _launch(*TINY, "--training.steps", str(step + 1), "--job.dump_folder", str(tmp_path), NGPU="2")
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0 and f"resumed from {tmp_path / 'checkpoint' / f'step-{step}'}" in out, out[-3000:]


def _children(pid: int) -> list[int]:
    from titan.launch.supervisor import child_pids

    return child_pids(pid)


@pytest.mark.slow
def test_kill_9_of_the_launcher_group_stops_the_ranks(tmp_path):
    # Neither the run's end nor the watch's kill after its grace period can come before the guard
    # below: a rank that ends in time ended through its SIGTERM handler (save, then exit).
    proc = _launch(
        *TINY,
        "--training.steps",
        "1000000",
        "--job.dump_folder",
        str(tmp_path),
        NGPU="2",
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="900",
    )
    try:
        _until_step(proc, 3)
        ranks = _children(proc.pid)  # run_train.sh execs the launcher, whose children are the ranks
        assert len(ranks) == 2, ranks
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert all(wait_gone(p, 600) for p in ranks), "ranks train on without their launcher"
    finally:
        for p in _children(proc.pid):
            os.kill(p, signal.SIGKILL)


# ---------------------------------------------------------------- restarts inside the job
def _losses(dump: Path) -> list[tuple[int, float]]:
    """Every loss the run logged, at full precision (the metrics JSONL of every attempt)."""
    rows = [json.loads(line) for p in sorted((dump / "metrics").glob("*.jsonl")) for line in p.read_text().splitlines()]
    return [(r["step"], r["loss_metrics/global_avg_loss"]) for r in rows if "loss_metrics/global_avg_loss" in r]


def _adds_up(record: dict) -> bool:
    from titan.training.goodput import FIGURES

    return abs(sum(record[k] for k in FIGURES) - record["wall"]) <= 0.01 * record["wall"]


RESTART_RUN = [*TINY, "--metrics.enable_jsonl", "--checkpoint.interval", "2", "--training.steps", "7"]


@pytest.mark.slow
def test_a_killed_rank_is_restarted_and_the_run_ends_with_the_uninterrupted_losses(tmp_path):
    ref = _launch(*RESTART_RUN, "--job.dump_folder", str(tmp_path / "ref"), NGPU="2")
    out = ref.communicate(timeout=300)[0]
    assert ref.returncode == 0, out[-3000:]
    reference = dict(_losses(tmp_path / "ref"))
    assert sorted(reference) == list(range(1, 8))

    # rank 1 is SIGKILLed after step 5 of the first attempt only (step 4 is the newest checkpoint)
    proc = _launch(
        *RESTART_RUN,
        "--job.dump_folder",
        str(tmp_path / "run"),
        NGPU="2",
        MAX_RESTARTS="2",
        **kill_env("step=5@rank1@attempt0"),
    )
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, out[-3000:]
    killed = r"rank 1 \(pid \d+\) was killed by SIGKILL.*restarting the ranks \(restart 1 of 2\)"
    assert re.search(killed, out), out[-3000:]
    assert "resumed from" in out and "restart 2 of 2" not in out, out[-3000:]
    logged = _losses(tmp_path / "run")
    assert [s for s, _ in logged] == [1, 2, 3, 4, 5, 5, 6, 7], logged  # step 5 done twice
    assert all(v == reference[s] for s, v in logged), (logged, reference)

    from titan.training.goodput import read_attempts

    first, second = read_attempts(str(tmp_path / "run" / "goodput.jsonl"))
    assert (first["run"], first["attempt"], second["run"], second["attempt"]) == (1, 1, 1, 2)
    assert first["kind"] == second["kind"] == "end" and second["cause"] == "finished", (first, second)
    assert first["committed"] == 4 and second["restart_cause"].startswith("titan: error: rank 1"), (first, second)
    assert second["recomputed"] > 0 and second["restart"] > 0 and second["startup"] > 0, second
    assert _adds_up(first) and _adds_up(second), (first, second)
    assert "goodput: run so far (2 attempts)" in out, out[-3000:]


@pytest.mark.slow
def test_a_titan_error_in_the_ranks_is_not_restarted(tmp_path):
    missing = tmp_path / "missing"
    proc = _launch(
        "--training.dataset_path", str(missing), "--job.dump_folder", str(tmp_path), NGPU="2", MAX_RESTARTS="3"
    )
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2, out[-3000:]
    line = f"titan: error: dataset path '{missing}' does not exist (training.dataset_path)"
    assert out.strip().splitlines()[-1] == line, out[-3000:]
    assert "not restarting after a titan error" in out and "restarting the ranks" not in out, out[-3000:]


def test_a_config_error_is_not_restarted():
    proc = _launch("--training.stepz", "3", NGPU="2", MAX_RESTARTS="3")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and out.strip().splitlines() == [
        "titan: error: unknown config key 'training.stepz'; did you mean 'training.steps'?"
    ], out[-3000:]


@pytest.mark.slow
def test_a_spent_restart_budget_ends_with_the_last_cause(tmp_path):
    # rank 1 dies after step 2 on every attempt: one restart, then the end
    proc = _launch(
        *TINY,
        "--training.steps",
        "4",
        "--job.dump_folder",
        str(tmp_path),
        NGPU="2",
        MAX_RESTARTS="1",
        **kill_env("step=2@rank1"),
    )
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert "restarting the ranks (restart 1 of 1)" in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"titan: error: rank 1 \(pid \d+\) was killed by SIGKILL; .*"
        r" \(gave up after 1 restart\(s\): --max-restarts 1\)",
        last,
    ), last


# ---------------------------------------------------------------- the launcher around any script
_ATTEMPT = """
import json, os, sys
env = {k: os.environ.get(k) for k in ("TORCHELASTIC_RESTART_COUNT", "TITAN_LAUNCHER_PID", "TITAN_RESTART_CAUSE",
                                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
print("attempt " + json.dumps(env), flush=True)
if sys.argv[1] == "titan-error":  # what train.py does after a user error
    line = "titan: error: dataset path '/x' does not exist (training.dataset_path)"
    print(line, file=sys.stderr)
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": line, "timestamp": 0}, f)
    sys.exit(2)
sys.exit(5)
"""


def _launch_script(tmp_path: Path, how: str) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "attempt.py"
    script.write_text(_ATTEMPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", TITAN_LAUNCH_SUMMARY=str(tmp_path / "summary"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "titan.launch",
            "--nproc_per_node",
            "1",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "localhost:0",
            "--max-restarts",
            "1",
            str(script),
            how,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, proc.communicate(timeout=300)[0]


@pytest.mark.slow
def test_a_crash_is_restarted_with_its_cause_and_the_last_line_is_the_cause_once(tmp_path):
    proc, out = _launch_script(tmp_path, "crash")
    assert proc.returncode == 5, out[-3000:]
    cause = "titan: error: rank 0 exited with status 5; its output above says why"
    last = out.strip().splitlines()[-1]
    assert last == f"{cause} (gave up after 1 restart(s): --max-restarts 1)", out[-3000:]
    assert out.count(last) == 1 and "Traceback" not in out, out[-3000:]
    assert (tmp_path / "summary").read_text() == last + "\n"
    attempts = [json.loads(line.removeprefix("attempt ")) for line in out.splitlines() if line.startswith("attempt ")]
    assert [a["TORCHELASTIC_RESTART_COUNT"] for a in attempts] == ["0", "1"], out[-3000:]
    assert {a["TITAN_LAUNCHER_PID"] for a in attempts} == {str(proc.pid)}
    assert all(a["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" for a in attempts)
    assert [a["TITAN_RESTART_CAUSE"] for a in attempts] == [None, cause]


@pytest.mark.slow
def test_a_titan_error_ends_the_launch_with_its_line_once_and_exit_2(tmp_path):
    proc, out = _launch_script(tmp_path, "titan-error")
    line = "titan: error: dataset path '/x' does not exist (training.dataset_path)"
    assert proc.returncode == 2, out[-3000:]
    assert out.strip().splitlines()[-1] == line and "not restarting after a titan error" in out, out[-3000:]
    assert len([a for a in out.splitlines() if a.startswith("attempt ")]) == 1, out[-3000:]
    assert (tmp_path / "summary").read_text() == line + "\n"
