"""``scripts/benchmark_recovery.py --replica_groups N``: the same failure injection (seeded
exponential inter-arrival times of mean --mtbf, a SIGKILL to a random rank) on N torchft replica
groups of one CPU rank each (``NGPU=1 REPLICA_GROUPS=N ./run_train.sh``, each group restarted by
its own launcher), against the same groups uninterrupted.

1. The reference: the groups uninterrupted, stopped (SIGTERM to their launchers: they save and
   exit 0) after --seconds of training; the step they reached is the length of both runs.
2. The faulty run: the same with failures, to that step. Its step time at full strength is the
   mean time per step, from the groups' own log timestamps, over the stretches where no failure
   is being recovered (from a kill to its group's heal): checkpoint saves and the other periodic
   work of a full-strength run stay in it. Measured in the same run because a shared machine's
   speed drifts between runs.

The last line is JSON: failures, restarts, steps, committed_group_steps, discarded_steps, heals,
heal_s (per failure: the kill to its group's return: healed from a live peer, or, when no live peer
was ahead of it (both groups down at once, or the other still starting), resumed from its own
snapshot at the same step), recovery and recover_s (per restart,
titan's own record of it in the group's goodput.jsonl: detect, restart, rejoin, reload,
recompute, from the failed attempt's last finished step to the group's first new step),
goodput = committed group-steps / (groups x the steps the wall time holds at full strength),
heals_bitwise_equal (every group's final weights and optimizer state equal, bitwise: a healed
group took its peer's state exactly; not so after trained_alone, the restarts that found every
other group finished and trained the last steps alone),
final_loss and final_loss_uninterrupted: the final weights' loss on the same held-out text (the
pydoc_validation topics, which pydoc_train, the runs' data, leaves out; 128-token windows): the
groups' last training batches differ between the runs (a restarted group reads on from its own
data position); train_loss_last50 of both runs (mean and spread over both groups' last 50
steps); and load, the machine's 1-minute load average at the start and the end.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

STEP_LINE = re.compile(r"\[replica(\d+)_rank0\]:.*step:\s*(\d+)\s+loss:\s*([0-9.]+)")
# titan's own time stamp of a line (the console's arrival times carry the pipes' buffering)
STAMP = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(groups: int) -> dict[str, str]:
    return {"NGPU": "1", "REPLICA_GROUPS": str(groups), "LIGHTHOUSE_PORT": str(_port())}


def _stamp(t: float, line: str) -> float:
    """The line's own time stamp (titan's logger), else its arrival time."""
    m = STAMP.search(line)
    return datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else t


def _steps(run: Any) -> list[tuple[float, int, int, float]]:
    """(time, group, step, loss) of every step line."""
    return [
        (_stamp(t, line), int(m[1]), int(m[2]), float(m[3]))
        for t, line in list(run.lines)
        if (m := STEP_LINE.search(line))
    ]


def full_strength_step_s(lines: list[tuple[float, int, int, float]], windows: list[tuple[float, float]]) -> float:
    """Mean seconds per step of each group's consecutive steps that overlap no recovery window."""
    deltas = []
    for g in {g for _, g, _, _ in lines}:
        own = sorted((t, s) for t, gg, s, _ in lines if gg == g)
        for (t0, s0), (t1, s1) in zip(own, own[1:]):
            if s1 == s0 + 1 and not any(t0 < end and t1 > start for start, end in windows):
                deltas.append(t1 - t0)
    return statistics.fmean(deltas)


def _newest(folder: Path) -> Path:
    """The newest step-N folder (the reference saves when it is stopped)."""
    return max(folder.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def _state(folder: Path, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder / f"final_{step}.pt"
    dcp_to_torch_save(str(folder / "checkpoint" / f"step-{step}"), str(target))
    state = torch.load(target, weights_only=False)
    return {"model": state["model"], "optimizer": state["optimizer"]}


def _heldout_loss(step_dir: Path, seq: int = 128, windows: int = 64) -> float:
    """The checkpoint's mean next-token loss over the first ``windows`` windows of pydoc_validation."""
    from pydoc_data.topics import topics

    from titan.data.datasets import PYDOC_VALIDATION_EVERY
    from titan.data.tokenizer import build_tokenizer
    from titan.tools.generate import load_model

    tokenizer = build_tokenizer("")
    ids: list[int] = []
    for key in sorted(topics)[::PYDOC_VALIDATION_EVERY]:
        ids += tokenizer.encode(topics[key], bos=True, eos=True)
    data = torch.tensor(ids[: windows * seq + 1])
    inputs = data[:-1].view(windows, seq)
    labels = data[1:].view(windows, seq)
    model = load_model(step_dir, max_seq_len=seq, device=torch.device("cpu"), flavor="debugmodel").eval()
    with torch.no_grad():
        logits = model(inputs)
    return round(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item(), 4)


def _last_steps_loss(run: Any, last: int = 50) -> tuple[float, float]:
    """Mean and standard deviation of both groups' training loss over their last ``last`` steps."""
    lines = _steps(run)
    end = max(s for _, _, s, _ in lines)
    losses = [loss for _, _, s, loss in lines if s > end - last]
    return round(statistics.fmean(losses), 4), round(statistics.stdev(losses), 4)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _recovery(folder: Path) -> list[dict[str, float]]:
    """The recovery parts of every restarted attempt of one group (its goodput record)."""
    from titan.training.goodput import RECOVERY, read_attempts

    attempts = read_attempts(str(folder / "goodput.jsonl"))
    return [{k: round(x["recovery"][k], 2) for k in RECOVERY} for x in attempts if x.get("recovery")]


def _group_lines(text: list[tuple[float, str]], pattern: str) -> list[tuple[float, int]]:
    """(time, group) of every line matching ``pattern`` (its first group: the replica group)."""
    return [(t, int(m[1])) for t, line in text if (m := re.search(pattern, line))]


def _group_of(rank: int) -> int:
    """A rank's replica group: its launcher's --fault_tolerance.replica_id (a rank started ahead of
    the launcher's check, a standby, does not carry the flags on its own command line)."""
    with open(f"/proc/{rank}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    args = Path(f"/proc/{parent}/cmdline").read_text().split("\0")
    return int(args[args.index("--fault_tolerance.replica_id") + 1])


def main(a: Any, out: Path, launch: Any, run_args: Any, ranks: Any) -> int:
    groups = a.replica_groups
    load = [round(os.getloadavg()[0], 1)]
    # 1. reference
    ref = launch(run_args(out / "reference", a.interval, 1_000_000), out / "reference.log", **_env(groups))
    while len({g for _, g, _, _ in _steps(ref)}) < groups and ref.proc.poll() is None:
        time.sleep(0.2)
    time.sleep(a.seconds)
    for pid in ranks(ref.proc.pid, 0):  # the launchers (not the lighthouse: the last steps need it)
        if b"titan.launch" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGTERM)
    if ref.wait() != 0:
        sys.exit(f"the reference run failed: see {out / 'reference.log'}")
    lines = _steps(ref)
    steps = min(max(s for _, g, s, _ in lines if g == i) for i in range(groups))
    own = sorted((t, s) for t, g, s, _ in lines if g == 0)
    step_s = (own[-1][0] - own[0][0]) / max(own[-1][1] - own[0][1], 1)
    print(f"benchmark: reference reached step {steps}, {step_s:.3f} s per step", file=sys.stderr, flush=True)
    # 2. with failures
    rng = random.Random(a.seed)
    env = {**_env(groups), "MAX_RESTARTS": "1000"}
    run = launch(run_args(out / "faulty", a.interval, steps), out / "faulty.log", **env)
    t0 = time.time()
    kills: list[tuple[float, int]] = []
    due = t0 + rng.expovariate(1 / a.mtbf)
    while run.proc.poll() is None:
        time.sleep(0.05)
        if time.time() < due:
            continue
        victims = ranks(run.proc.pid, groups)
        if not victims:
            continue
        victim = rng.choice(victims)
        try:
            group = _group_of(victim)
            os.kill(victim, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError, IndexError, ValueError):
            continue
        kills.append((time.time(), group))
        print(f"benchmark: {time.time() - t0:7.1f} s: SIGKILL to group {group}", file=sys.stderr, flush=True)
        due = time.time() + rng.expovariate(1 / a.mtbf)
    rc = run.wait()
    text = [(_stamp(t, line), line) for t, line in run.lines]
    lines = _steps(run)
    discarded = [(t, line) for t, line in text if "discarded (a replica group failed" in line]
    prefix = r"replica group (\d+)(?: \(restart \d+\))?"
    healed = _group_lines(text, prefix + " healed from a live peer")
    # a restarted group trains again: healed, or on its own state when no live peer is ahead of it
    back = _group_lines(text, prefix + "(?: healed from a live peer|: no live peer)")
    end = max(t for t, *_ in lines)
    heal_s, windows = [], []
    for k, g in kills:
        done = next((t for t, hg in back if hg == g and t > k), None)
        windows.append((k, end if done is None else done))
        if done is not None:
            heal_s.append(round(done - k, 1))
    committed = len(lines) - len(discarded)
    step_s = full_strength_step_s(lines, windows)
    wall = end - min(t for t, *_ in lines) + step_s  # the first step's own time included
    states = [_state(out / "faulty" / f"replica_{i}", steps) for i in range(groups)]
    recovery = [r for i in range(groups) for r in _recovery(out / "faulty" / f"replica_{i}")]
    load.append(round(os.getloadavg()[0], 1))
    result = {
        "failures": len(kills),
        "restarts": sum("restarting the ranks" in line for _, line in text),
        "steps": steps,
        "committed_group_steps": committed,
        "discarded_steps": len({line.split("step ")[1].split(" ")[0] for _, line in discarded}),
        "heals": len(healed),
        # restarted after every other group finished: trained its last steps alone (its own weights)
        "trained_alone": sum(bool(re.search(r"\(restart \d+\): no live peer;", line)) for _, line in text),
        "heal_s": heal_s,
        "recover_s": [round(sum(r.values()), 2) for r in recovery],
        "recovery": recovery,
        "goodput": round(committed / (groups * wall / step_s), 4),
        "heals_bitwise_equal": all(_equal(states[0], s) for s in states[1:]),
        "final_loss": _heldout_loss(out / "faulty" / "replica_0" / "checkpoint" / f"step-{steps}"),
        "final_loss_uninterrupted": _heldout_loss(_newest(out / "reference" / "replica_0" / "checkpoint")),
        "train_loss_last50": _last_steps_loss(run),
        "train_loss_last50_uninterrupted": _last_steps_loss(ref),
        "wall_s": round(wall, 1),
        "step_s_full_strength": round(step_s, 3),
        "load": load,
        "status": rc,
    }
    print(json.dumps(result))
    return 0 if rc == 0 and result["heals_bitwise_equal"] else 1
