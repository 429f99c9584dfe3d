"""Replica groups through torchft, as users launch them: a real lighthouse on localhost and one
launcher (torchrun) per group, gloo between the groups. A group killed mid-step does not stop the
other; restarted by its own launcher it heals from the live peer (weights and optimizer state
equal, bitwise); a config error in one group is not retried. The kill-and-heal run trains in
bfloat16 parameters (the default), the others in float32."""

from __future__ import annotations

import glob
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.debug_kill import READY_ENV, WAIT_ENV, kill_env
from tests.helpers.replica_groups import STEPS, flat, group, output
from tests.helpers.replica_groups import lighthouse as start_lighthouse
from tests.helpers.runs import REPO, STEP_RE, run_env

pytest.importorskip("torchft")


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """A lighthouse that forms a quorum from one group (so a survivor goes on alone) and notices a
    dead group within a second."""
    flags = ["--join_timeout_ms", "20000", "--heartbeat_timeout_ms", "1000", "--quorum_tick_ms", "50"]
    with start_lighthouse(1, *flags) as url:
        yield url


def final_state(folder: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (step,) = glob.glob(str(folder / "checkpoint" / f"step-{STEPS}"))
    out = folder / "final.pt"
    dcp_to_torch_save(step, str(out))
    return torch.load(out, weights_only=False)


def test_killed_group_heals_from_live_peer(lighthouse: str, tmp_path: Path) -> None:
    ready, ready0 = str(tmp_path / "ready1"), str(tmp_path / "ready0")
    # Both groups start their first step with the other up (one first quorum holds both), and
    # group 0 its step 5 once group 1's restart is up: the kill and the return are ordered
    # against group 0's steps by events, not timers. Group 0 only discarded a step meanwhile (its
    # weights are group 1's snapshot's), yet it is a step on: group 1 heals to take its step.
    gates = {WAIT_ENV: f"step=1:{ready}.0,step=5:{ready}.1", READY_ENV: ready0}
    bf16 = ("--training.mixed_precision_param", "bfloat16")
    g0 = group(lighthouse, tmp_path, 0, *bf16, env=kill_env("", gates) | gates)
    # Group 1 dies inside step 4, after its backward, before the gradient exchange.
    g1_env = kill_env("sync:step=4@attempt0") | {READY_ENV: ready, WAIT_ENV: f"step=1:{ready0}.0"}
    g1 = group(lighthouse, tmp_path, 1, *bf16, env=g1_env, restarts=1)
    out1 = output(g1, tmp_path, 1, timeout=180)
    out0 = output(g0, tmp_path, 0, timeout=60)
    assert g0.returncode == 0, out0[-3000:]
    assert g1.returncode == 0, out1[-3000:]
    # The survivor went on: every step of its own, the one with the failure discarded, not applied.
    assert sorted({int(m[1]) for m in STEP_RE.finditer(out0)}) == list(range(1, STEPS + 1))
    assert "step 4 discarded" in out0 and "SIGKILL at sync of step 4" in out1
    # The restarted group took the peer's state and step, not its own fresh start, and says so
    # (not that it starts again from step 0); then both train steps 5-9 together.
    assert "replica group 1 (restart 1) healed from a live peer at step 5" in out1
    # ... as soon as its first quorum brought the peer's state: the step's forward runs on it
    assert "at step 5 (before the step's forward)" in out1
    assert "starts again from step 0" not in out1
    # Its data reads on after its last step (step 4 died before its update: its batches come again):
    # from its in-memory snapshot of step 3, or from the position kept per step when that snapshot
    # was still being copied (then it resumed from an older one).
    assert "resumed from the in-memory snapshot of step 3" in out1 or "data position of step 3 restored" in out1
    assert "resumed from the in-memory snapshot of step" in out1, out1[-3000:]
    # Each group's goodput record counts its replica-group steps.
    assert "replica group steps this attempt: 8 committed, 1 discarded; 0 heal(s)" in out0
    assert "replica group steps this attempt: 5 committed, 0 discarded; 1 heal(s)" in out1
    # The console reads like titan: no traceback (the survivor's failed collective is in its
    # torchft log file, with torchft's per-step quorum lines), and besides one line per step few
    # others: a 60-step run of the two groups with one kill stays under 200 lines.
    others = 0
    for out in (out0, out1):
        assert "Traceback" not in out and "[torchft::" not in out and "torchft.manager" not in out, out[-3000:]
        assert "Warning" not in out, out[-3000:]  # torch's deprecated variable, its read-only buffer
        others += len(out.splitlines()) - len(STEP_RE.findall(out))
    assert others + 2 * 60 < 200, out0 + out1
    torchft_log = (tmp_path / "r0" / "torchft_replica0_rank0.log").read_text()
    assert "got exception waiting for work" in torchft_log and "Traceback" in torchft_log
    a, b = flat(final_state(tmp_path / "r0")), flat(final_state(tmp_path / "r1"))
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            other = b[key]
            assert isinstance(other, torch.Tensor) and torch.equal(value, other), key
        else:
            assert value == b[key], key


def test_replica_id_used_twice_stops_the_newcomer(lighthouse: str, tmp_path: Path) -> None:
    # Group A (id 0) trains its first step alone, then holds before its step 2 until B (also id 0)
    # is about to ask for its first quorum, so that quorum holds both: B stops with its line,
    # before it trains; A trains on.
    ready = str(tmp_path / "ready_b")
    gates = {WAIT_ENV: f"step=2:{ready}.0"}
    a = group(lighthouse, tmp_path, 0, env=kill_env("", gates) | gates)
    log_a = tmp_path / "group0.log"
    deadline = time.monotonic() + 180
    while not STEP_RE.search(log_a.read_text()):  # A's first step is an event in its log
        assert a.poll() is None and time.monotonic() < deadline, log_a.read_text()[-3000:]
        time.sleep(0.1)
    b_folder = tmp_path / "b"
    b_folder.mkdir()
    b = group(lighthouse, b_folder, 0, env=kill_env("", {READY_ENV: ready}) | {READY_ENV: ready}, restarts=2)
    out_b = output(b, b_folder, 0, timeout=180)
    out_a = output(a, tmp_path, 0, timeout=120)
    assert b.returncode == 2, out_b[-3000:]
    assert (
        "config key 'fault_tolerance.replica_id' = 0 is already used by another live replica group"
        in (out_b.splitlines()[-1])
    )
    assert not STEP_RE.search(out_b), out_b[-3000:]  # not one step trained
    assert "restart 1 of" not in out_b  # a user error: its launcher does not retry it
    assert a.returncode == 0, out_a[-3000:]
    assert sorted({int(m[1]) for m in STEP_RE.finditer(out_a)}) == list(range(1, STEPS + 1))


def test_config_error_in_one_group_is_not_retried(tmp_path: Path) -> None:
    # A rank's own user error (here: a lighthouse address that is no address) ends the group
    # with its one line and exit status 2; its launcher does not restart it.
    g = group("localhost-without-port", tmp_path, 1, env={}, restarts=3)
    out = output(g, tmp_path, 1, timeout=120)
    assert g.returncode == 2, out[-3000:]
    assert "TORCHFT_LIGHTHOUSE='localhost-without-port' is not a lighthouse address" in out.splitlines()[-1]
    assert out.count("is not a lighthouse address; valid") <= 2, out[-3000:]  # the rank's line and the launcher's


def test_torchtitan_llama3_ft_config_dry_runs_and_trains(lighthouse: str, tmp_path: Path) -> None:
    """torchtitan v0.2.2's llama3_ft debug config as written (its plug-in config module line, its
    [fault_tolerance] section: DiLoCo over 2 fragments, sync every 10 steps, nccl between groups),
    run from a folder laid out as torchtitan's repository (its tokenizer folder). On CPU one line
    says gloo replaces nccl. Shrunk for time as torchtitan's own tests shrink it: 5 steps (the
    first fragment's synchronization), 32-token windows, no profiler traces."""
    config = REPO / "tests/fixtures/torchtitan/llama3_ft_debug_model.toml"
    tokenizer = tmp_path / "tests/assets/tokenizer"
    tokenizer.mkdir(parents=True)
    shutil.copy(REPO / "titan/data/assets/tokenizer.model", tokenizer)
    env = run_env(PYTHONPATH=str(REPO), TORCHFT_LIGHTHOUSE=lighthouse)
    base = [sys.executable, str(REPO / "train.py"), "--job.config_file", str(config)]
    dry = subprocess.run([*base, "--job.dry_run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert "dry run: llama3 debugmodel on 8 ranks" in dry.stdout + dry.stderr
    shrink = ["--training.steps", "5", "--training.seq_len", "32", "--profiling.enable_profiling", "false"]
    run = subprocess.run(
        [*base, *shrink, "--job.dump_folder", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "fault_tolerance.process_group = nccl needs CUDA: replica groups use gloo on this CPU machine" in out
    assert sorted(int(m[1]) for m in STEP_RE.finditer(out)) == [1, 2, 3, 4, 5]
    # DiLoCo's inner steps and its one synchronization so far, in the goodput record
    assert "replica group steps this attempt: 5 committed, 0 discarded" in out
    assert "; 1 synchronization(s), 0 failed" in out, out[-3000:]
