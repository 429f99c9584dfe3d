"""Goodput: how much of a run's wall time went into training steps that count.

Rank 0 records every attempt of a run (a launch, and each restart of the ranks by the launcher) in
``<job.dump_folder>/goodput.jsonl``, one JSON object a line:

- ``start``: the attempt's start, the step it resumed from and, after a restart, the launcher's
  line for why the previous attempt ended;
- ``progress`` at every log step and after each committed checkpoint: the time, the step reached,
  the newest committed checkpoint step and the attempt's figures so far (a heartbeat: a killed
  rank writes nothing more, so the next attempt ends a killed attempt at its last heartbeat);
- ``end``: the same figures at the end of the attempt and its cause (finished, stopped after a
  signal, the error; ``reconstructed`` when the next attempt wrote it from the last heartbeat).

An attempt's wall time is cut into consecutive pieces, so the figures add up to it exactly:
``restart`` (after a restart: from the previous attempt's last record to this process's start:
failure detection, the unfinished step, stopping and starting the ranks), ``startup`` (process
start to the first step: imports, process group, model build, checkpoint load), then per step
``productive`` (a step done for the first time in this run) or ``recomputed`` (a step an earlier
attempt had done already: it was after the checkpoint the run resumed from), ``checkpoint``
(blocking checkpoint work, the final save included), ``validation``, and ``other`` (what is left:
the work after the last step). Goodput = productive / wall, for the attempt and for the run so far
(all attempts of the run: a new run starts at step 0 outside a restart; time between separate
launches, e.g. a Slurm requeue waiting in the queue, is not the run's wall time).

After a restart by the launcher the attempt also records its ``recovery``: from the failed
attempt's last finished step to this attempt's first new one, in parts that add up to it:
``detect`` (the failed rank's process ended -> the launcher saw it), ``restart`` (stopping the
other ranks, rendezvous, the new rank processes: warm standbys or fresh interpreters), ``rejoin``
(the new ranks' start-up without the state: config, process group, model, optimizer, data loader),
``reload`` (the state: in-memory snapshot or disk checkpoint) and ``recompute`` (the step in flight
when it failed, and every step done again). Rank 0 keeps a heartbeat
(``goodput.heartbeat``: its last finished step, rewritten in place after each step) that tells the
next attempt where the failed one really stood.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

from titan.log import logger

RECORD_FILE = "goodput.jsonl"
FIGURES = ("productive", "restart", "startup", "recomputed", "checkpoint", "validation", "other")
LOST = FIGURES[1:]
RESTART_CAUSE_ENV = "TITAN_RESTART_CAUSE"  # set by titan.launch before it restarts the ranks
FAILED_AT_ENV = "TITAN_FAILED_AT"  # ... with when each failed attempt's first rank process ended
DETECTED_AT_ENV = "TITAN_FAILURE_SEEN_AT"  # ... and when the launcher saw it (epoch seconds)
STARTED_AT_ENV = "TITAN_PROCESS_STARTED_AT"  # a warm standby's start as a rank (titan.launch.standby)
HEARTBEAT_FILE = "goodput.heartbeat"
RECOVERY = ("detect", "restart", "rejoin", "reload", "recompute")
_HEARTBEAT_BYTES = 512


def process_start_time() -> float:
    """This process's start as a rank, as epoch seconds: a warm standby's assignment, else the
    process's start (Linux /proc, to 10 ms), else now."""
    if os.environ.get(STARTED_AT_ENV):
        return float(os.environ[STARTED_AT_ENV])
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def read_attempts(path: str) -> list[dict[str, Any]]:
    """The last record of each attempt in the file, in the order the attempts started (a line torn
    by a kill is skipped)."""
    last: dict[tuple[int, int], dict[str, Any]] = {}
    starts: dict[tuple[int, int], dict[str, Any]] = {}
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
            key = (int(rec["run"]), int(rec["attempt"]))
        except (ValueError, KeyError, TypeError):
            continue
        if rec.get("kind") == "start":
            starts[key] = rec
        last[key] = {**starts.get(key, {}), **rec, "kind": rec.get("kind")}
    return [last[k] for k in sorted(last)]


def read_heartbeat(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, HEARTBEAT_FILE)) as f:
            return json.loads(f.read().strip())
    except (OSError, ValueError):
        return None


def _env_time(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def _env_times(name: str) -> list[float]:
    try:
        return sorted(float(t) for t in os.environ.get(name, "").split(",") if t)
    except ValueError:
        return []


def recovery_text(parts: dict[str, float]) -> str:
    return ", ".join(f"{k} {parts[k]:.2f}" for k in RECOVERY) + f" = {sum(parts[k] for k in RECOVERY):.2f} s"


def summary(figures: dict[str, float]) -> str:
    wall = figures["wall"]
    lost = ", ".join(f"{k.replace('startup', 'start-up')} {figures[k]:.1f}" for k in LOST)
    return (
        f"wall {wall:.1f} s = productive {figures['productive']:.1f} s + lost {wall - figures['productive']:.1f} s"
        f" ({lost}); goodput {100 * goodput(figures):.1f}%"
    )


def goodput(figures: dict[str, float]) -> float:
    return figures["productive"] / figures["wall"] if figures["wall"] > 0 else 0.0


class GoodputRecorder:
    """One per trainer, built once the checkpoint is loaded (``step``: the step resumed from).
    The loop calls ``begin`` before its first step, ``step_done`` after each, ``add`` /
    ``lost`` around blocking checkpoint work and validation, and ``end`` / ``failed`` once.
    Only rank 0 records; on the other ranks every call returns at once."""

    def __init__(self, config: Any, *, rank: int, step: int, metrics: Any = None) -> None:
        self.active = rank == 0
        self.ended = False
        # Replica groups (titan/ft): this group's committed and discarded steps and its heals (an
        # object with those counters, or None); shown in every record and the end line.
        self.replicas: Any = None
        if not self.active:
            return
        self.metrics = metrics
        self.path = os.path.join(config.job.dump_folder, RECORD_FILE)
        # One clock for the whole attempt: epoch-based for the records, monotonic in between.
        self._epoch0, self._mono0 = time.time(), time.monotonic()
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.launch = f"{socket.gethostname()}:{os.environ.get('TITAN_LAUNCHER_PID', os.getppid())}"
        attempts = read_attempts(self.path)
        prev = attempts[-1] if attempts else None
        continuing = restart > 0 and prev is not None and prev.get("launch") == self.launch
        # A restarted replica group says itself where it goes on from (a peer, or its own start).
        if restart > 0 and not config.checkpoint.enable and not config.fault_tolerance.enable:
            logger.warning(
                f"restart {restart} of the ranks without checkpoint.enable: training starts again"
                " from step 0 (every step so far is recomputed)"
            )
        started = min(process_start_time(), self.now())
        # A new run starts at step 0, unless the launcher restarted the ranks of this one.
        self.run = (prev["run"] + (0 if continuing or step > 0 else 1)) if prev else 1
        earlier = [a for a in attempts if a["run"] == self.run]
        self.attempt = (earlier[-1]["attempt"] + 1) if earlier else 1
        beat = read_heartbeat(config.job.dump_folder)
        last_step_at = None  # the previous attempt's last finished step, from its heartbeat
        if earlier and beat and (beat.get("run"), beat.get("attempt")) == (self.run, earlier[-1]["attempt"]):
            last_step_at = float(beat.get("time", 0.0))
        if earlier and earlier[-1]["kind"] != "end":
            last = earlier[-1]
            if last_step_at is not None and last_step_at > last.get("time", 0.0):
                last = {**last, **(beat or {})}  # its figures up to its last finished step
            earlier[-1] = self._close_killed(last, continuing)
        # steps the earlier attempts finished: done again from here on, they count as recomputed
        finished = [a.get("step", 0) for a in earlier[:-1]]
        finished.append(
            beat["step"] if beat and last_step_at is not None else earlier[-1].get("step", 0) if earlier else 0
        )
        self.redo_until = max(finished)
        self.run_before = {k: sum(a.get(k, 0.0) for a in earlier) for k in ("wall", *FIGURES)}
        self.start = min(earlier[-1]["time"], started) if continuing and earlier else started
        self.fig: dict[str, float] = dict.fromkeys(FIGURES, 0.0)
        self.fig["restart"] = started - self.start
        self._mark = started
        self._pending = 0.0  # checkpoint/validation time inside the current step
        self.first_step: float | None = None
        self.step, self.committed = step, -1
        self._beat: int | None = None
        self._recovered = False
        self.recovery: dict[str, float] | None = None
        seen = _env_time(DETECTED_AT_ENV)
        since = last_step_at if last_step_at is not None else self.start
        failed = [t for t in _env_times(FAILED_AT_ENV) if t >= since]
        if continuing and earlier and failed and seen is not None:
            # From the last finished step to this process's start, cut by the launcher's times: the
            # step in flight, then detection of the last failure, the rest restarts (with any
            # restarted attempt that failed again before its first step).
            self.recovery = dict.fromkeys(RECOVERY, 0.0)
            self.recovery["recompute"] = failed[0] - since
            self.recovery["detect"] = max(seen - failed[-1], 0.0)
            self.recovery["restart"] = max(started - since - self.recovery["recompute"] - self.recovery["detect"], 0.0)
        self._start_record = {
            "kind": "start",
            "time": self.start,
            "process_start": started,
            "step": step,
            "launch": self.launch,
            "restart": restart,
            "restart_cause": os.environ.get(RESTART_CAUSE_ENV) if restart > 0 else None,
        }

    def now(self) -> float:
        return self._epoch0 + (time.monotonic() - self._mono0)

    def _close_killed(self, prev: dict[str, Any], restarted: bool) -> dict[str, Any]:
        """The previous attempt ended without its record (its rank 0 was killed): end it at its
        last record, with the launcher's cause when the launcher restarted the ranks."""
        cause = (restarted and os.environ.get(RESTART_CAUSE_ENV)) or "ended without a record (rank 0 killed?)"
        end = {**prev, "kind": "end", "cause": cause, "reconstructed": True}
        if "wall" not in end:  # killed before its first step: its time is in the next attempt's restart
            end.update(dict.fromkeys(FIGURES, 0.0), wall=0.0)
        self._write(end)
        logger.warning(
            f"goodput: attempt {end['attempt']} ended at step {end.get('step', 0)} without its record"
            f" ({cause}); from its last record: {summary(end)}"
        )
        return end

    def _write(self, record: dict[str, Any]) -> None:
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({"run": self.run, "attempt": self.attempt, **record}) + "\n")
        except OSError as e:  # the record is a report: losing it must not stop training
            logger.warning(f"goodput: could not write {self.path}: {e}")

    # -------------------------------------------------------------- the loop's calls
    def begin(self, reload_s: float = 0.0) -> None:
        """Start-up is over: the first step comes next. ``reload_s``: the part of the start-up spent
        loading the state (snapshot or checkpoint)."""
        if not self.active:
            return
        now = self.now()
        if self.recovery is not None:
            self.recovery["reload"] = reload_s
            self.recovery["rejoin"] = max(now - self._mark - self._pending - reload_s, 0.0)
            self._start_record["recovery"] = dict(self.recovery)
        self._write(self._start_record)
        self.fig["startup"] += now - self._mark - self._pending
        self._mark, self._pending = now, 0.0

    def add(self, kind: str, seconds: float) -> None:
        """Blocking ``checkpoint`` or ``validation`` time inside the current piece."""
        if self.active:
            self.fig[kind] += seconds
            self._pending += seconds

    @contextlib.contextmanager
    def lost(self, kind: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(kind, time.monotonic() - t0)

    def step_done(self, step: int, committed: int) -> None:
        if not self.active:
            return
        now = self.now()
        piece = now - self._mark - self._pending
        redone = step <= self.redo_until
        self.fig["recomputed" if redone else "productive"] += piece
        if self.recovery is not None and not self._recovered:
            if redone:
                self.recovery["recompute"] += piece
            else:  # the first new step: the recovery ended where it began
                self._recovered = True
                logger.info(
                    f"goodput: recovered from attempt {self.attempt - 1}'s failure: {recovery_text(self.recovery)}"
                )
        self._mark, self._pending = now, 0.0
        self._heartbeat(step, now)
        if self.first_step is None:
            self.first_step = now
        new_commit = committed != self.committed
        self.step, self.committed = step, committed
        if new_commit or self.metrics is None or self.metrics.should_log(step):
            self._write(self._record("progress", now))

    def _heartbeat(self, step: int, now: float) -> None:
        """This attempt's last finished step, rewritten in place (one small write, no new file)."""
        try:
            if self._beat is None:
                self._beat = os.open(
                    os.path.join(os.path.dirname(self.path) or ".", HEARTBEAT_FILE), os.O_WRONLY | os.O_CREAT, 0o644
                )
            record = {"run": self.run, "attempt": self.attempt, "step": step, "time": now, **self.figures(now)}
            os.pwrite(self._beat, json.dumps(record).ljust(_HEARTBEAT_BYTES).encode(), 0)
        except OSError:
            pass

    def figures(self, now: float) -> dict[str, float]:
        fig = dict(self.fig)
        fig["other"] += now - self._mark - self._pending
        return {"wall": now - self.start, **fig}

    def _record(self, kind: str, now: float) -> dict[str, Any]:
        return {
            "kind": kind,
            "time": now,
            "step": self.step,
            "committed": self.committed,
            "first_step": self.first_step,
            **self.figures(now),
            **({"recovery": dict(self.recovery)} if self.recovery is not None else {}),
            **({"replica_group": dataclasses.asdict(self.replicas)} if self.replicas is not None else {}),
        }

    def end(self, step: int, committed: int, cause: str) -> dict[str, float] | None:
        """Close the attempt: the end record, the log line and the metrics outputs. Returns the
        scalars written (None on ranks other than 0, and after the first call)."""
        if not self.active or self.ended:
            return None
        self.ended = True
        self.step, self.committed = max(self.step, step), committed
        now = self.now()
        record = {**self._record("end", now), "cause": cause}
        self._write(record)
        attempt = {k: record[k] for k in ("wall", *FIGURES)}
        run = {k: self.run_before[k] + attempt[k] for k in attempt}
        logger.info(f"goodput: attempt {self.attempt} ({cause}): {summary(attempt)}")
        logger.info(f"goodput: run so far ({self.attempt} attempt{'s' * (self.attempt > 1)}): {summary(run)}")
        if self.replicas is not None:
            r = self.replicas
            logger.info(
                f"goodput: replica group steps this attempt: {r.committed} committed, {r.discarded} discarded;"
                f" {r.heals} heal(s) from a live peer ({r.heal_seconds:.1f} s loading its state)"
                + (f"; {r.synced} synchronization(s), {r.sync_failed} failed" if r.synced or r.sync_failed else "")
            )
        scalars = {"goodput/attempt(%)": 100 * goodput(attempt), "goodput/run(%)": 100 * goodput(run)}
        scalars.update({f"goodput/attempt_{k}(s)": v for k, v in attempt.items()})
        scalars.update({f"goodput/run_{k}(s)": v for k, v in run.items()})
        if self.metrics is not None:
            try:
                self.metrics.write(self.step, scalars)
            except Exception as e:  # a report must not hide the attempt's own outcome
                logger.warning(f"goodput: could not write the figures to the metrics outputs: {e}")
        return scalars

    def failed(self, step: int, committed: int, error: BaseException) -> None:
        text = str(error).strip()
        first = text.splitlines()[0] if text else type(error).__name__
        self.end(step, committed, f"failed: {first[:200]}")
