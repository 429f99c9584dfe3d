"""Fault recovery as a user meets it: train.py killed with SIGKILL (mid-save too), restarted, and
stopped with SIGTERM. 1 process, tiny model, 6 steps with a save every 2 (a kill point needs a
complete save before it and another after it; more steps only add run time)."""

import importlib.util
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.debug_kill import kill_env
from tests.helpers.runs import REPO, STEP_RE, TINY_CKPT, run_env, train_subprocess

pytestmark = pytest.mark.slow


def _to_torch(ckpt: Path, dst: Path) -> dict:
    spec = importlib.util.spec_from_file_location("dcp_to_torch", REPO / "scripts/dcp_to_torch.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["to-torch", str(ckpt), str(dst)]) == 0
    return torch.load(dst, weights_only=False)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _eq(x, y) -> bool:
    if isinstance(x, bytes):  # pickled per-rank blobs: pickling a tensor is not byte-stable
        x, y = pickle.loads(x), pickle.loads(y)
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and sorted(x) == sorted(y) and all(_eq(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_eq, x, y))
    return x == y


def _same(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors bitwise)."""
    a, b = _flat(a), _flat(b)
    assert sorted(a) == sorted(b)
    return [k for k in a if not _eq(a[k], b[k])]


def test_kill_9_at_several_points_then_resume(tmp_path):
    # the disk checkpoints under test: a restart would take the newer in-memory snapshot
    args = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.memory_interval", "0"]
    rc, text, ref = train_subprocess(tmp_path / "ref", *args)
    assert rc == 0 and sorted(ref) == list(range(1, 7)), text[-3000:]

    run = tmp_path / "run"
    ckpt = run / "checkpoint"
    # 1) async save of step 4: every file and DCP's .metadata written, killed before the commit
    rc, text, _ = train_subprocess(run, *args, "--checkpoint.async_mode", "async", kill_at="save:step=4")
    assert rc == -signal.SIGKILL, text[-3000:]
    assert (ckpt / "step-2/COMPLETE").is_file()
    assert (ckpt / "step-4/.metadata").is_file() and not (ckpt / "step-4/COMPLETE").exists()
    # 2) restart: step 4 is torn, so resume from 2; killed right after step 5, before any save
    rc, text, steps = train_subprocess(run, *args, kill_at="step=5")
    assert rc == -signal.SIGKILL, text[-3000:]
    assert "step-4 is incomplete" in text and "resumed from" in text and "step-2: step 2" in text, text[-3000:]
    assert sorted(steps) == [3, 4, 5] and all(steps[s] == ref[s] for s in steps), (steps, ref)
    assert (ckpt / "step-4/COMPLETE").is_file() and not (ckpt / "step-6").exists()
    # 3) restart: resume from 4 and finish exactly like the uninterrupted run
    rc, text, steps = train_subprocess(run, *args)
    assert rc == 0 and "step-4: step 4" in text, text[-3000:]
    assert steps == {5: ref[5], 6: ref[6]}
    # bitwise: final weights, optimizer moments, LR, data position, RNG all equal the reference
    final = _to_torch(ckpt / "step-6", tmp_path / "run6.pt")
    assert _same(final, _to_torch(tmp_path / "ref/checkpoint/step-6", tmp_path / "ref6.pt")) == []
    assert {"model", "optimizer", "lr_scheduler", "train_state"} <= set(final)
    per_rank = torch.load(ckpt / "step-6/rank_0.pt", weights_only=True)
    assert _same(per_rank, torch.load(tmp_path / "ref/checkpoint/step-6/rank_0.pt", weights_only=True)) == []
    assert set(per_rank) == {"dataloader", "rng"}
    # and back: torch.save file -> DCP folder that holds the same state
    spec = importlib.util.spec_from_file_location("dcp_to_torch", REPO / "scripts/dcp_to_torch.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["to-dcp", str(tmp_path / "run6.pt"), str(tmp_path / "back")]) == 0
    assert _same(final, _to_torch(tmp_path / "back", tmp_path / "back.pt")) == []


def test_sigterm_saves_current_step_and_exits_0(tmp_path):
    cmd = [
        sys.executable,
        "train.py",
        *TINY_CKPT,
        "--job.dump_folder",
        str(tmp_path),
        "--training.steps",
        "6",
        "--checkpoint.interval",
        "1000",
    ]
    # the run holds after step 2 until it is signalled: it cannot have finished before the signal
    env = run_env(**kill_env("hold:step=2"))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if (m := STEP_RE.search(line)) and m[1] == "2":  # training is under way: preempt it
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    assert rc == 0, text[-3000:]
    last = max(int(m[1]) for m in STEP_RE.finditer(text))
    assert last == 2 and "received SIGTERM" in text, text[-3000:]
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] == [f"step-{last}"]
    assert (tmp_path / "checkpoint" / f"step-{last}" / "COMPLETE").is_file()
