"""Launch scripts: syntax, shellcheck, the dry run through run_train.sh as a user runs it, the
replica-group launch of run_train.sh and multinode_trainer.slurm (layout, dump folders, bad input:
on stand-ins for python, srun and scontrol), user errors (one line, exit 2, no torchrun
traceback), signals to the launcher (save, exit 0, resume, no restart), kill -9 of the launcher
(the ranks stop), and restarts inside the job (MAX_RESTARTS): a killed rank is restarted and the
run ends with the uninterrupted losses and goodput records that add up; a titan error is not
restarted; a spent budget ends with the last cause."""

import json
import os
import re
import shutil
import signal
import socket
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
    # the simulator needs no launcher: one process plays a rank of NGPU ranks
    assert _run_train_sh_argv(tmp_path, "--training.steps", "5", COMM_MODE="fake_backend") == [
        "scripts/simulate.py",
        "--world_size",
        "2",
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--training.steps",
        "5",
    ]


def test_run_train_sh_refuses_a_comm_mode_it_does_not_have():
    env = dict(os.environ, COMM_MODE="local_tensor", NGPU="2")
    out = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith("titan: error: COMM_MODE='local_tensor' is not a mode titan has; valid: fake_backend")


def _shims(tmp_path: Path, **scripts: str) -> Path:
    """A folder of stand-in commands for PATH (name -> bash body)."""
    bin_dir = tmp_path / "shims"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_run_train_sh_puts_replica_groups_under_the_merged_dump_folder(tmp_path):
    """REPLICA_GROUPS: each group's folder is under the job.dump_folder the ranks will read, here
    set in the TOML file only (a `python` on PATH writes down each launcher's arguments and passes
    the config check on to Python; TORCHFT_LIGHTHOUSE names a listening port, which the config check
    connects to: no lighthouse is started)."""
    calls = tmp_path / "calls"
    calls.mkdir()
    record = 'if [ "$1 $2" = "-m titan.launch" ]; then printf "%s\\n" "$@" > "$CALLS/$$"; exit 0; fi'
    shims = _shims(tmp_path, python=f'{record}\nexec "{sys.executable}" "$@"')
    config = tmp_path / "run.toml"
    config.write_text(
        f'extends = "{REPO / "train_configs/debug_model.toml"}"\n[job]\ndump_folder = "{tmp_path}/out/"\n'
    )
    env = {k: v for k, v in os.environ.items() if k not in ("COMM_MODE", "MAX_RESTARTS")}
    env.update(
        PATH=f"{shims}:{os.environ['PATH']}",
        CALLS=str(calls),
        CONFIG_FILE=str(config),
        NGPU="1",
        REPLICA_GROUPS="2",
        CUDA_VISIBLE_DEVICES="",
    )
    with socket.socket() as lighthouse:
        lighthouse.bind(("127.0.0.1", 0))
        lighthouse.listen()
        env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{lighthouse.getsockname()[1]}"
        out = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    launched = sorted(
        (p.read_text().splitlines() for p in calls.iterdir()),
        key=lambda a: a[a.index("--fault_tolerance.replica_id") + 1],
    )
    assert [a[a.index("--job.dump_folder") + 1] for a in launched] == [f"{tmp_path}/out/replica_{i}" for i in range(2)]
    assert all(dict(zip(a, a[1:]))["--max-restarts"] == "3" for a in launched), launched


# The Slurm script's replica-group layout, on stand-ins for srun and scontrol: nodes n0.. with
# addresses 10.0.0.<i>; each srun call is written down (TORCHFT_LIGHTHOUSE and its arguments).
SRUN = """{ echo "TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-}"; printf '%s\\n' "$@"; } > "$CALLS/$$"
case "$*" in *SLURMD_NODENAME*) for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do echo "n$i 10.0.0.$i"; done ;; esac"""
SCONTROL = 'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do echo "n$i"; done'
# the config check prints the merged dump folder; the GPU count of a node is 8
PYTHON = """case "$*" in *--print_value*) echo /dump/ ;; *device_count*) echo 8 ;; esac
printf '%s\\n' "$@" > "$CALLS/python-$$"
"""


def _slurm_script(tmp_path: Path, nodes: int, lighthouse: bool = True, **env_extra: str):
    """multinode_trainer.slurm run by bash as Slurm would run it on an allocation of ``nodes``
    nodes: (its result, the srun and python calls it made)."""
    calls = tmp_path / "calls"
    calls.mkdir(exist_ok=True)
    shims = {"srun": SRUN, "scontrol": SCONTROL, "python": PYTHON}
    if lighthouse:
        shims["torchft_lighthouse"] = "exit 0"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TORCHFT", "CUDA_VISIBLE"))}
    env.update(
        PATH=f"{_shims(tmp_path, **shims)}:/usr/bin:/bin",
        CALLS=str(calls),
        SLURM_JOB_ID="7",
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_JOB_NODELIST=f"n[0-{nodes - 1}]",
        **env_extra,
    )
    out = subprocess.run(
        ["bash", str(REPO / "multinode_trainer.slurm"), "--training.steps", "5"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out, [p.read_text().splitlines() for p in sorted(calls.iterdir())]


def _groups(calls: list[list[str]]) -> dict[int, list[str]]:
    """The groups' srun calls by replica id."""
    steps = [c for c in calls if c[0].startswith("TORCHFT_LIGHTHOUSE=") and "--fault_tolerance.replica_id" in c]
    return {int(c[c.index("--fault_tolerance.replica_id") + 1]): c for c in steps}


def test_slurm_replica_groups_on_whole_nodes_with_the_users_lighthouse(tmp_path):
    out, calls = _slurm_script(tmp_path, 4, lighthouse=False, REPLICA_GROUPS="2", TORCHFT_LIGHTHOUSE="http://lh:1")
    assert out.returncode == 0, out.stderr
    assert not any("torchft_lighthouse" in " ".join(c) for c in calls)  # TORCHFT_LIGHTHOUSE names one
    assert "lighthouse: http://lh:1" in out.stdout, out.stdout
    groups = _groups(calls)
    assert sorted(groups) == [0, 1]
    for g, hosts in [(0, "n0,n1"), (1, "n2,n3")]:
        call = groups[g]
        flags = dict(zip(call, call[1:]))
        assert call[0] == "TORCHFT_LIGHTHOUSE=http://lh:1" and "--overlap" not in call, call
        assert "--nodes=2" in call and "--ntasks=2" in call, call
        assert flags["-w"] == hosts and flags["--nnodes"] == "2" and flags["--nproc_per_node"] == "8", call
        assert flags["--rdzv_endpoint"] == f"10.0.0.{2 * g}:29500" and flags["--max-restarts"] == "3", call
        assert flags["--fault_tolerance.group_size"] == "2" and flags["--job.dump_folder"] == f"/dump/replica_{g}"
        assert flags["--role"] == f"replica{g}_rank" and not any(a.startswith("CUDA_VISIBLE_DEVICES=") for a in call)
    assert not list((tmp_path / "logs").iterdir())  # the launch summaries' folder is gone


def test_slurm_replica_groups_sharing_nodes_split_their_gpus(tmp_path):
    out, calls = _slurm_script(tmp_path, 2, REPLICA_GROUPS="4", GPUS_PER_NODE="8", LIGHTHOUSE_PORT="29999")
    assert out.returncode == 0, out.stderr
    (lighthouse,) = [c for c in calls if "--bind" in c]
    assert "--overlap" in lighthouse and dict(zip(lighthouse, lighthouse[1:]))["-w"] == "n0", lighthouse
    assert "[::]:29999" in lighthouse and "lighthouse: http://10.0.0.0:29999" in out.stdout
    groups = _groups(calls)
    for g, (node, port, gpus) in enumerate(
        [("n0", 29500, "0,1,2,3"), ("n0", 29501, "4,5,6,7"), ("n1", 29500, "0,1,2,3"), ("n1", 29501, "4,5,6,7")]
    ):
        call = groups[g]
        flags = dict(zip(call, call[1:]))
        assert call[0] == "TORCHFT_LIGHTHOUSE=http://10.0.0.0:29999" and "--overlap" in call, call
        assert flags["-w"] == node and flags["--nproc_per_node"] == "4" and flags["--nnodes"] == "1", call
        assert flags["--rdzv_endpoint"] == f"10.0.0.{node[1]}:{port}" and f"CUDA_VISIBLE_DEVICES={gpus}" in call


@pytest.mark.parametrize(
    "nodes, groups, gpus, lighthouse, line",
    [
        (1, "0", "2", True, "REPLICA_GROUPS='0' is not a number of replica groups (1 or more)"),
        (
            4,
            "3",
            "8",
            True,
            "REPLICA_GROUPS=3 does not divide the job's 4 nodes:"
            " every replica group gets the same number of whole nodes",
        ),
        (
            4,
            "6",
            "8",
            True,
            "REPLICA_GROUPS=6 is not a multiple of the job's 4 nodes:"
            " groups that share nodes are as many on every node",
        ),
        (
            1,
            "3",
            "2",
            True,
            "REPLICA_GROUPS=3 on 1 node(s) puts 3 groups on each node, which does not divide its GPUS_PER_NODE=2 ranks",
        ),
        (
            2,
            "2",
            "8",
            False,
            "REPLICA_GROUPS needs torchft's lighthouse (torchft_lighthouse is not on PATH): pip install 'titan[ft]'",
        ),
    ],
    ids=["zero", "not-dividing-nodes", "not-a-multiple", "not-dividing-gpus", "no-torchft"],
)
def test_slurm_bad_replica_group_input_is_one_line_and_starts_nothing(tmp_path, nodes, groups, gpus, lighthouse, line):
    if not lighthouse and shutil.which("torchft_lighthouse", path="/usr/bin:/bin"):
        pytest.skip("torchft_lighthouse is in /usr/bin or /bin here: no PATH can hide it to show the no-torchft line")
    out, calls = _slurm_script(tmp_path, nodes, lighthouse=lighthouse, REPLICA_GROUPS=groups, GPUS_PER_NODE=gpus)
    assert out.returncode == 2 and out.stderr == f"titan: error: {line}\n" and out.stdout == "", out
    assert calls == []  # not even the config check


@pytest.mark.parametrize(
    "env, line",
    [
        ({"REPLICA_GROUPS": "0"}, "REPLICA_GROUPS='0' is not a number of replica groups (1 or more)"),
        ({"REPLICA_GROUPS": "x"}, "REPLICA_GROUPS='x' is not a number of replica groups (1 or more)"),
        (
            {"REPLICA_GROUPS": "2", "PATH": "/usr/bin:/bin"},
            "REPLICA_GROUPS needs torchft's lighthouse (torchft_lighthouse is not on PATH): pip install 'titan[ft]'",
        ),
    ],
    ids=["zero", "not-a-number", "no-torchft"],
)
def test_run_train_sh_bad_replica_group_input_is_one_line(env, line):
    if "PATH" in env and shutil.which("torchft_lighthouse", path=env["PATH"]):
        pytest.skip(f"torchft_lighthouse is in {env['PATH']} here: no PATH can hide it to show the no-torchft line")
    env = {k: v for k, v in os.environ.items() if k != "TORCHFT_LIGHTHOUSE"} | {"NGPU": "1"} | env
    out = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and out.stderr == f"titan: error: {line}\n", out


_SHORT = ("--model.n_layers", "2", "--training.seq_len", "64", "--training.local_batch_size", "2")


@pytest.mark.slow
def test_run_train_sh_fake_backend_simulates_a_rank_of_hsdp():
    out = _run_train_sh("--parallelism.data_parallel_replicate_degree", "2", "--simulate.rank", "5", *_SHORT, NGPU="8")
    assert "simulate: llama3 debugmodel (dp_replicate 2, dp_shard 4), optimizer AdamW; rank 5 of 8" in out.stdout
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["world_size"] == 8 and last["rank"] == 5 and last["tensors"] == "fake"
    assert {"all_gather@dp_shard", "all_reduce@dp_replicate"} <= set(last["collectives_by_group"]), last


@pytest.mark.slow
def test_run_train_sh_detects_the_gpu_count():
    import torch

    n = max(torch.cuda.device_count(), 1)  # a CPU-only machine runs 1 process
    out = _run_train_sh(*_SHORT)
    assert json.loads(out.stdout.strip().splitlines()[-1])["world_size"] == n, out.stdout


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


def test_a_data_error_ends_before_any_rank_starts_in_one_line(tmp_path):
    """The launch check reads the files the config names: torchrun never starts, nothing is written."""
    proc = _launch("--training.dataset_path", str(tmp_path / "missing"), "--job.dump_folder", str(tmp_path), NGPU="2")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2, out[-3000:]
    line = f"titan: error: dataset path '{tmp_path / 'missing'}' does not exist (training.dataset_path)"
    assert out.strip().splitlines() == [line], out[-3000:]
    assert list(tmp_path.iterdir()) == []


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
    assert proc.stdout is not None
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
        TITAN_WARM_RESTARTS="1",  # the restarted ranks are warm standbys
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
    # the ranks came back from warm standbys and resumed from step 4 (their in-memory snapshots, or
    # the disk checkpoint when the snapshot of step 4 was skipped: the last one still copying); the
    # step killed, 5, was done again; the recovery's parts are in the record
    assert re.search(r"resumed from (the in-memory snapshot of step 4|\S+step-4: step 4)", out), out[-3000:]
    parts = second["recovery"]
    assert all(parts[k] >= 0 for k in ("detect", "restart", "rejoin", "reload")) and parts["recompute"] > 0, parts
    assert "goodput: recovered from attempt 1's failure: detect" in out, out[-3000:]


@pytest.mark.slow
def test_a_titan_error_in_the_ranks_is_not_restarted(tmp_path):
    """A titan error raised inside the ranks (rank 1, hidden by LOG_RANK=0) ends the run with its line
    last and once, instead of torchrun's traceback, and is not restarted."""
    proc = _launch(
        *TINY,
        "--training.steps",
        "3",
        "--job.dump_folder",
        str(tmp_path),
        NGPU="2",
        MAX_RESTARTS="3",
        **kill_env("error:step=1@rank1"),
    )
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2, out[-3000:]
    line = "titan: error on rank 1: TITAN_DEBUG_KILL_AT: injected failure after step 1"
    assert out.strip().splitlines()[-1] == line and out.count(line) == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
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
