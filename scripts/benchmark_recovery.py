"""Fault injection: a 2-rank CPU run of the debug model through run_train.sh with restarts on,
one rank SIGKILLed at random times, against the same run uninterrupted.

    python scripts/benchmark_recovery.py --seconds 300 --mtbf 60 --seed 0 [--interval 50] [--out DIR]
    python scripts/benchmark_recovery.py --seconds 120 --mtbf 40 --seed 0 --lose_memory --interval 10
    python scripts/benchmark_recovery.py --replica_groups 2 --seconds 300 --mtbf 60 --seed 0
(--lose_memory: each failure kills every rank and removes the job's in-memory snapshots, as when
the nodes are lost: the restart resumes from the disk checkpoint. --replica_groups: the same
failure injection on N torchft replica groups of one rank each; scripts/benchmark_replica_groups.py
says what it measures.)

1. The reference: ``./run_train.sh`` (NGPU=2) of ``train_configs/debug_model.toml`` with no
   failures, stopped by SIGTERM after ``--seconds`` (it saves and exits 0); the step it reached
   is the length of both runs. The LR schedule is warmup then constant
   (``--lr_scheduler.decay_ratio 0``), so a run cut short and a run configured for that many steps
   take the same steps.
2. The faulty run: the same command with ``MAX_RESTARTS`` high, a disk checkpoint every
   ``--interval`` steps (written in the background: ``checkpoint.async_mode async``), in-memory
   snapshots every step (the default) and ``--training.steps`` set to the reference's last step.
   Failures arrive with exponential inter-arrival times of mean ``--mtbf`` seconds (seeded); each
   SIGKILLs a random rank of the current attempt (a failure due while the ranks are being restarted
   hits the next ones as soon as they exist). The launcher restarts the ranks (warm standbys:
   titan/launch/standby.py); they resume from the newest state: their in-memory snapshots, else the
   newest intact checkpoint.

The last line is JSON:

    {"failures": ..., "restarts": ..., "steps": ..., "losses_identical": true, "recover_s": [...],
     "recovery": [{"detect": ..., "restart": ..., "rejoin": ..., "reload": ..., "recompute": ...}, ...],
     "goodput": ..., "wall_s": ..., "lost_s": {"restart": ..., "startup": ..., ...}, "reference_s": ...,
     "load": [...]}

losses_identical: every loss the faulty run logged (the metrics JSONL of every attempt, full
precision, recomputed steps included) equals the reference's at that step. recover_s and
recovery: per failure, titan's own measure of the recovery (the restarted attempt's goodput record:
from the failed attempt's last finished step to the first new step, in its parts);
kill_to_step_s: per failure, from the kill to the next step line after the launcher's restart.
goodput and lost_s: titan's own record of the faulty run (``<dump_folder>/goodput.jsonl``, all
attempts). load: the machine's 1-minute load average at the start and the end (other work on the
machine slows both runs and the recoveries).

Targets: with --mtbf 60, every loss identical, goodput >= 0.95 and each recovery < 3 s on a
2-core machine. What is lost per failure: detection (the launcher polls every 0.1 s), the
restart (stopping the survivor, a rendezvous, handing each rank to a warm standby), the rejoin
(config, process group, model build), the reload (the in-memory snapshot: a copy from /dev/shm),
and the recompute (the step in flight, plus a step whose snapshot was still being copied). None of
it grows with the checkpoint interval; with --lose_memory the steps since the last disk checkpoint
come back (on average interval/2 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titan.launch.supervisor import child_pids  # noqa: E402
from titan.training.goodput import FIGURES, LOST, RECOVERY, read_attempts  # noqa: E402

STEP_RE = re.compile(r"step:\s*(\d+)\s+loss")
LOSS_KEY = "loss_metrics/global_avg_loss"


def _args(dump: Path, interval: int, steps: int) -> list[str]:
    return [
        "--checkpoint.async_mode",
        "async",
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--lr_scheduler.decay_ratio",
        "0",
        # pydoc without the pydoc_validation topics: the replica-group runs measure their final
        # weights on those, held out
        "--training.dataset",
        "pydoc_train",
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(interval),
        "--metrics.enable_jsonl",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.disable_color_printing",
    ]


class Launch:
    """./run_train.sh in its own process group; every output line kept with its arrival time."""

    def __init__(self, args: list[str], log: Path, **env: str) -> None:
        environ = dict(
            os.environ,
            NGPU="2",
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            HF_DATASETS_OFFLINE="1",
            HF_HUB_OFFLINE="1",
            PYTHONPATH=str(REPO),
            PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        )
        environ.update(env)
        environ.pop("TITAN_DEBUG_KILL_AT", None)
        self.lines: list[tuple[float, str]] = []
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            ["./run_train.sh", *args],
            cwd=REPO,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))
            self.log.write(line)
        self.log.flush()

    def last_step(self) -> int:
        steps = [int(m[1]) for _, line in list(self.lines) if (m := STEP_RE.search(line))]
        return max(steps, default=0)

    def wait(self) -> int:
        rc = self.proc.wait()
        self.reader.join()
        self.log.close()
        return rc


def _losses(dump: Path) -> list[tuple[int, float]]:
    out = []
    for path in sorted((dump / "metrics").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if LOSS_KEY in rec:
                out.append((int(rec["step"]), float(rec[LOSS_KEY])))
    return out


def reference(out: Path, seconds: float, interval: int) -> tuple[dict[int, float], int, float]:
    """Uninterrupted, stopped by SIGTERM after ``seconds`` of training (the first step starts the clock)."""
    t0 = time.time()
    run = Launch(_args(out / "reference", interval, 1_000_000), out / "reference.log")
    while run.last_step() == 0 and run.proc.poll() is None:
        time.sleep(0.2)
    time.sleep(seconds)
    os.killpg(run.proc.pid, signal.SIGTERM)
    rc = run.wait()
    if rc != 0:
        sys.exit(f"the reference run failed (status {rc}): see {out / 'reference.log'}")
    losses = dict(_losses(out / "reference"))
    return losses, max(losses), time.time() - t0


def _memory_folders(dump: Path) -> list[Path]:
    """The job's in-memory snapshot folder(s) (titan/checkpointing/snapshot_store.py job_folder)."""
    from titan.checkpointing.snapshot_store import job_folder

    return [Path(job_folder("/dev/shm", str(dump / "checkpoint")))]


def faulty(out: Path, steps: int, interval: int, mtbf: float, seed: int, lose_memory: bool = False) -> dict:
    rng = random.Random(seed)
    run = Launch(_args(out / "faulty", interval, steps), out / "faulty.log", MAX_RESTARTS="1000")
    t0 = time.time()
    kills: list[float] = []
    due = t0 + rng.expovariate(1 / mtbf)
    while run.proc.poll() is None:
        time.sleep(0.05)
        if time.time() < due:
            continue
        ranks = _ranks(run.proc.pid, 0)  # run_train.sh execs the launcher: its children are the ranks
        if not ranks:
            continue
        victim = rng.choice(ranks)
        try:
            for pid in ranks if lose_memory else [victim]:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        if lose_memory:  # the nodes' memory is gone with them
            for folder in _memory_folders(out / "faulty"):
                shutil.rmtree(folder, ignore_errors=True)
        kills.append(time.time())
        what = "every rank and their memory" if lose_memory else f"rank pid {victim}"
        print(f"benchmark: {time.time() - t0:7.1f} s: SIGKILL to {what}", file=sys.stderr, flush=True)
        due = time.time() + rng.expovariate(1 / mtbf)
    rc = run.wait()
    wall = time.time() - t0
    restarts = [t for t, line in run.lines if "restarting the ranks" in line]
    steps_at = [t for t, line in run.lines if STEP_RE.search(line)]
    recover = []
    for k in kills:
        restart = next((t for t in restarts if t >= k), None)
        step = next((t for t in steps_at if restart is not None and t > restart), None)
        if step is not None:
            recover.append(round(step - k, 2))
    return {"rc": rc, "kills": kills, "restarts": len(restarts), "recover_s": recover, "wall": wall}


def _ranks(pid: int, groups: int) -> list[int]:
    """The ranks under run_train.sh: its own children (one group), or its launchers' (groups)."""
    top = child_pids(pid)
    return sorted(top if groups == 0 else [r for launcher in top for r in child_pids(launcher)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=240, help="training time of the reference run")
    p.add_argument("--mtbf", type=float, default=60, help="mean seconds between failures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interval", type=int, default=50, help="checkpoint.interval (steps) of the disk checkpoints")
    p.add_argument(
        "--lose_memory", action="store_true", help="each failure: every rank killed and its snapshots removed"
    )
    p.add_argument("--out", default=None, help="folder for both runs and their logs (default: a temporary one)")
    p.add_argument("--replica_groups", type=int, default=0, help="N replica groups of 1 rank (torchft) instead")
    a = p.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="titan-recovery-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"benchmark: runs and logs in {out}", file=sys.stderr, flush=True)
    if a.replica_groups:
        from benchmark_replica_groups import main as groups_main

        return groups_main(a, out, Launch, _args, _ranks)

    load = [round(os.getloadavg()[0], 1)]
    ref, steps, ref_s = reference(out, a.seconds, a.interval)
    print(f"benchmark: reference reached step {steps} in {ref_s:.0f} s", file=sys.stderr, flush=True)
    run = faulty(out, steps, a.interval, a.mtbf, a.seed, a.lose_memory)
    load.append(round(os.getloadavg()[0], 1))
    if run["rc"] != 0:
        print(f"benchmark: the faulty run ended with status {run['rc']}: see {out / 'faulty.log'}", file=sys.stderr)
    logged = _losses(out / "faulty")
    attempts = [x for x in read_attempts(str(out / "faulty" / "goodput.jsonl")) if x["run"] == 1]
    total = {k: sum(x.get(k, 0.0) for x in attempts) for k in ("wall", *FIGURES)}
    recovery = [{k: round(x["recovery"][k], 2) for k in RECOVERY} for x in attempts if x.get("recovery")]
    result = {
        "failures": len(run["kills"]),
        "restarts": run["restarts"],
        "steps": max((s for s, _ in logged), default=0),
        "losses_identical": bool(logged) and all(ref.get(s) == v for s, v in logged),
        "recover_s": [round(sum(r.values()), 2) for r in recovery],
        "recovery": recovery,
        "kill_to_step_s": run["recover_s"],
        "goodput": round(total["productive"] / total["wall"], 4) if total["wall"] else 0.0,
        "wall_s": round(total["wall"], 1),
        "lost_s": {k: round(total[k], 1) for k in LOST},
        "attempts": len(attempts),
        "reference_s": round(ref_s, 1),
        "load": load,
        "status": run["rc"],
    }
    print(json.dumps(result))
    return 0 if run["rc"] == 0 and result["losses_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
