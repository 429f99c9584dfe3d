"""Goodput records: every attempt in <dump_folder>/goodput.jsonl, figures that add up to the wall
time, a killed attempt closed by the next one from its last heartbeat, recomputed steps after a
restart, a new run at step 0, and the figures in a real training run's metrics JSONL."""

import json
import time
from types import SimpleNamespace

import pytest

from titan.training import goodput
from titan.training.goodput import FIGURES, RECORD_FILE, GoodputRecorder, read_attempts


class _Metrics:
    def __init__(self, log_every: int = 2) -> None:
        self.log_every = log_every
        self.written: list[tuple[int, dict]] = []

    def should_log(self, step: int) -> bool:
        return step % self.log_every == 0

    def write(self, step: int, scalars: dict) -> None:
        self.written.append((step, scalars))


def _config(folder, checkpoint: bool = True):
    return SimpleNamespace(job=SimpleNamespace(dump_folder=str(folder)), checkpoint=SimpleNamespace(enable=checkpoint))


def _attempt(
    folder,
    monkeypatch,
    *,
    start: int,
    last: int,
    restart: int = 0,
    killed: bool = False,
    interval: int = 2,
    cause_env: str | None = None,
):
    """One attempt: steps start+1..last (5 ms each, a checkpoint every ``interval`` steps, one
    validation), ended normally unless ``killed``."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    monkeypatch.setenv("TITAN_LAUNCHER_PID", "4242")
    monkeypatch.setattr(goodput, "process_start_time", time.time)  # each attempt is a new process
    if cause_env:
        monkeypatch.setenv("TITAN_RESTART_CAUSE", cause_env)
    metrics = _Metrics()
    rec = GoodputRecorder(_config(folder), rank=0, step=start, metrics=metrics)
    time.sleep(0.02)  # start-up
    rec.begin()
    committed = start
    for step in range(start + 1, last + 1):
        time.sleep(0.005)
        if step == start + 1:
            with rec.lost("validation"):
                time.sleep(0.01)
        rec.step_done(step, committed)
        if step % interval == 0:
            with rec.lost("checkpoint"):
                time.sleep(0.005)
            committed = step
    scalars = None if killed else rec.end(last, committed, "finished")
    return rec, metrics, scalars


def _adds_up(fig: dict) -> None:
    assert fig["wall"] > 0
    assert abs(sum(fig[k] for k in FIGURES) - fig["wall"]) <= 0.01 * fig["wall"], fig


def test_an_attempt_records_start_heartbeats_and_end_that_add_up(tmp_path, monkeypatch):
    rec, metrics, scalars = _attempt(tmp_path, monkeypatch, start=0, last=6)
    records = [json.loads(line) for line in (tmp_path / RECORD_FILE).read_text().splitlines()]
    assert [r["kind"] for r in records][0] == "start" and records[-1]["kind"] == "end"
    assert records[-1]["cause"] == "finished" and records[-1]["step"] == 6 and records[-1]["committed"] == 6
    assert any(r["kind"] == "progress" for r in records) and records[-1]["first_step"] is not None
    end = records[-1]
    _adds_up(end)
    assert end["startup"] >= 0.02 and end["validation"] >= 0.01 and end["checkpoint"] >= 0.015
    assert end["recomputed"] == 0 and end["restart"] == 0 and end["productive"] >= 6 * 0.005
    # the same figures went to the metrics outputs, and goodput is productive / wall
    assert metrics.written == [(6, scalars)]
    assert scalars["goodput/attempt(%)"] == pytest.approx(100 * end["productive"] / end["wall"])
    assert scalars["goodput/run(%)"] == scalars["goodput/attempt(%)"]
    assert scalars["goodput/attempt_wall(s)"] == end["wall"]


def test_a_killed_attempt_is_closed_by_the_next_and_its_steps_count_as_recomputed(tmp_path, monkeypatch):
    # killed after step 6 (last heartbeat: step 6, committed 4); the restart resumes from step 4
    _attempt(tmp_path, monkeypatch, start=0, last=6, killed=True, interval=4)
    time.sleep(0.03)  # failure detection and the restart of the ranks
    cause = "titan: error: rank 1 (pid 7) was killed by SIGKILL; the other ranks stopped with it"
    rec, metrics, scalars = _attempt(tmp_path, monkeypatch, start=4, last=8, restart=1, cause_env=cause)
    first, second = read_attempts(str(tmp_path / RECORD_FILE))
    assert (first["run"], first["attempt"], second["run"], second["attempt"]) == (1, 1, 1, 2)
    assert first["kind"] == "end" and first["reconstructed"] and first["cause"] == cause and first["step"] == 6
    assert second["cause"] == "finished" and second["restart_cause"] == cause
    _adds_up(first)
    _adds_up(second)
    # steps 5 and 6 were done before: recomputed; 7 and 8: productive
    assert second["recomputed"] >= 2 * 0.005 and second["productive"] >= 2 * 0.005
    assert second["restart"] >= 0.03 and second["time"] - second["wall"] == pytest.approx(first["time"], abs=1e-3)
    # the run so far: both attempts, gap included, still adding up
    run = {k: scalars[f"goodput/run_{k}(s)"] for k in ("wall", *FIGURES)}
    _adds_up(run)
    assert run["wall"] == pytest.approx(first["wall"] + second["wall"])
    assert scalars["goodput/run(%)"] == pytest.approx(100 * (first["productive"] + second["productive"]) / run["wall"])


def test_a_restart_records_its_recovery_in_parts_from_the_last_finished_step(tmp_path, monkeypatch):
    # killed after step 7: its last progress record is step 6's, its heartbeat step 7's
    _attempt(tmp_path, monkeypatch, start=0, last=7, killed=True, interval=4)
    beat = goodput.read_heartbeat(str(tmp_path))
    assert beat is not None and beat["step"] == 7
    time.sleep(0.01)  # the step in flight
    monkeypatch.setenv(goodput.FAILED_AT_ENV, repr(time.time()))
    time.sleep(0.02)  # until the launcher sees it
    monkeypatch.setenv(goodput.DETECTED_AT_ENV, repr(time.time()))
    time.sleep(0.01)  # the new ranks start (then 0.02 s of start-up; steps 5, 6, 7 again, then 8, 9)
    _attempt(tmp_path, monkeypatch, start=4, last=9, restart=1)
    first, second = read_attempts(str(tmp_path / RECORD_FILE))
    assert first["step"] == 7 and first["reconstructed"]
    parts = second["recovery"]
    assert set(parts) == set(goodput.RECOVERY)
    assert parts["detect"] >= 0.02 and parts["restart"] >= 0.01 and parts["rejoin"] >= 0.02
    assert parts["recompute"] >= 0.01 + 3 * 0.005 and parts["reload"] == 0
    assert sum(parts.values()) < second["time"] - beat["time"]  # from step 7's end to step 8's start


def test_a_new_run_starts_at_step_0_and_other_ranks_record_nothing(tmp_path, monkeypatch):
    _attempt(tmp_path, monkeypatch, start=0, last=2)
    _, _, scalars = _attempt(tmp_path, monkeypatch, start=0, last=2)  # a fresh launch, from scratch
    attempts = read_attempts(str(tmp_path / RECORD_FILE))
    assert [(a["run"], a["attempt"]) for a in attempts] == [(1, 1), (2, 1)]
    assert scalars["goodput/run_wall(s)"] == scalars["goodput/attempt_wall(s)"]
    # a later launch that resumes (Slurm requeue): the same run, without the time in between
    _attempt(tmp_path, monkeypatch, start=2, last=4)
    assert [(a["run"], a["attempt"]) for a in read_attempts(str(tmp_path / RECORD_FILE))][-1] == (2, 2)
    size = (tmp_path / RECORD_FILE).stat().st_size
    other = GoodputRecorder(_config(tmp_path), rank=1, step=0, metrics=_Metrics())
    other.begin()
    other.step_done(1, -1)
    assert other.end(1, -1, "finished") is None and (tmp_path / RECORD_FILE).stat().st_size == size


def test_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / RECORD_FILE
    path.write_text(
        json.dumps({"run": 1, "attempt": 1, "kind": "start", "time": 1.0, "step": 0})
        + "\n"
        + '{"run": 1, "attempt": 1, "kind": "progr'
    )
    assert [a["kind"] for a in read_attempts(str(path))] == ["start"]


@pytest.mark.slow
def test_a_training_run_writes_goodput_to_its_metrics_jsonl(tmp_path, monkeypatch):
    from tests.helpers.runs import trainer

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    t = trainer(tmp_path, "--metrics.enable_jsonl", "--checkpoint.enable", "--checkpoint.interval", "3")
    t.train()
    end = read_attempts(str(tmp_path / RECORD_FILE))[-1]
    assert end["cause"] == "finished" and end["step"] == 6 and end["committed"] == 6
    _adds_up(end)
    assert end["checkpoint"] > 0 and end["startup"] > 0 and end["productive"] > 0
    rows = [json.loads(line) for p in (tmp_path / "metrics").glob("*.jsonl") for line in p.read_text().splitlines()]
    figures = [r for r in rows if "goodput/run(%)" in r]
    assert len(figures) == 1 and figures[0]["step"] == 6
    assert figures[0]["goodput/attempt_productive(s)"] == end["productive"]
