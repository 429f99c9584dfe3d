from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import titan.training.metrics
from titan.config.job_config import Job, JobConfig, Metrics
from titan.training.metrics import MetricsProcessor, strip_color

LINE = re.compile(
    r"^step: {1,2}\d+  loss: [ \d.-]{7}  grad_norm: [ \d.-]{7}  "
    r"memory: [ \d]+\.\d\dGiB\([ \d]+\.\d\d%\)  tps: [\d,]+  tflops: [\d,]+\.\d\d  "
    r"mfu: (n/a|\d+\.\d\d%)"
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(titan.training.metrics, "time", SimpleNamespace(perf_counter=c.perf_counter))
    return c


def _processor(tmp_path: Path, *, rank: int = 0, color: bool = False, tb: bool = False, **kw):
    cfg = JobConfig(
        job=Job(dump_folder=str(tmp_path)),
        metrics=Metrics(log_freq=5, disable_color_printing=not color, enable_tensorboard=tb),
    )
    return MetricsProcessor(
        cfg.metrics,
        dump_folder=cfg.job.dump_folder,
        rank=rank,
        device=torch.device("cpu"),
        num_flops_per_token=10**9,
        **kw,
    )


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "titan" and "step:" in r.getMessage()]


def test_console_line_on_cpu(tmp_path: Path, clock: Clock, caplog) -> None:
    mp = _processor(tmp_path)
    for _ in range(3):  # three micro-batches
        mp.count_tokens(4000)
    mp.add_data_time(0.5)
    clock.now += 2.0
    with caplog.at_level(logging.INFO, logger="titan"):
        scalars = mp.log(1, loss=torch.tensor(2.5), grad_norm=1.25, lr=1e-3)
    [line] = _messages(caplog)
    assert LINE.match(line), line
    assert line.startswith("step:  1  loss:  2.5000  grad_norm:  1.2500  memory: ")
    assert line.endswith("tps: 6,000  tflops: 6.00  mfu: n/a")
    assert "\033[" not in line
    assert scalars["throughput(tps)"] == 6000
    assert scalars["time_metrics/data_loading(%)"] == pytest.approx(25.0)
    assert scalars["time_metrics/end_to_end(s)"] == pytest.approx(2.0)
    assert scalars["memory/rss(GiB)"] > 0 and 0 < scalars["memory/rss(%)"] < 100
    assert "mfu(%)" not in scalars


def test_known_peak_gives_mfu_and_window_resets(tmp_path: Path, clock: Clock, caplog) -> None:
    mp = _processor(tmp_path)
    mp.peak_flops = 989e12
    mp.reset(10)  # e.g. resumed at step 10
    mp.count_tokens(19780)
    clock.now += 4.0
    with caplog.at_level(logging.INFO, logger="titan"):
        scalars = mp.log(15, loss=1.0, grad_norm=0.5, lr=1e-4, extra={"loss_metrics/max": 1.5})
    [line] = _messages(caplog)
    # 19,780 tokens / 4 s = 4,945 tok/s; * 1 GFLOP = 4.945 TFLOP/s = 0.50 % of 989.
    assert "tps: 4,945  tflops: 4.95  mfu: 0.50%  loss_metrics/max: 1.5" in line
    assert scalars["mfu(%)"] == pytest.approx(0.5)
    assert scalars["time_metrics/end_to_end(s)"] == pytest.approx(0.8)  # 5 steps
    assert scalars["loss_metrics/max"] == 1.5
    clock.now += 1.0
    assert mp.log(20, loss=1.0, grad_norm=0.5, lr=1e-4)["throughput(tps)"] == 0


def test_non_data_parallel_devices_share_throughput(tmp_path: Path, clock: Clock) -> None:
    mp = _processor(tmp_path, non_data_parallel_size=2)
    mp.count_tokens(1000)
    clock.now += 1.0
    assert mp.log(1, loss=1.0, grad_norm=1.0, lr=1.0)["throughput(tps)"] == 500


def test_colors(tmp_path: Path, clock: Clock, caplog, monkeypatch) -> None:
    monkeypatch.setattr("titan.training.metrics.color_enabled", lambda disabled: not disabled)  # as on a terminal
    mp = _processor(tmp_path, color=True)
    mp.count_tokens(100)
    clock.now += 1.0
    with caplog.at_level(logging.INFO, logger="titan"):
        mp.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    [line] = _messages(caplog)
    assert "\033[" in line
    assert LINE.match(strip_color(line)), strip_color(line)


def test_only_rank0_prints_by_default(tmp_path: Path, clock: Clock, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="titan"):
        _processor(tmp_path, rank=1).log(1, loss=1.0, grad_norm=1.0, lr=1.0)
        assert _messages(caplog) == []
        _processor(tmp_path, rank=1, log_this_rank=True).log(1, loss=1.0, grad_norm=1.0, lr=1.0)
        assert len(_messages(caplog)) == 1


def test_should_log(tmp_path: Path) -> None:
    mp = _processor(tmp_path)
    assert [s for s in range(1, 16) if mp.should_log(s)] == [1, 5, 10, 15]


def test_tensorboard_scalars_round_trip(tmp_path: Path, clock: Clock) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert _processor(tmp_path, rank=1, tb=True).writer is None
    mp = _processor(tmp_path, tb=True)
    for step, loss in ((1, 3.0), (5, 2.0)):
        mp.count_tokens(2000)
        clock.now += 1.0
        mp.log(step, loss=loss, grad_norm=0.25 * step, lr=1e-3 * step, extra={"custom/x": 7.0})
    mp.close()

    tb_root = tmp_path / "tb"
    [run_dir] = list(tb_root.iterdir())
    assert mp.tb_log_dir == str(run_dir)
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "loss_metrics/global_avg_loss",
        "grad_norm",
        "lr",
        "throughput(tps)",
        "tflops",
        "time_metrics/end_to_end(s)",
        "time_metrics/data_loading(%)",
        "memory/rss(GiB)",
        "custom/x",
    ):
        assert tag in tags, tag
    assert "mfu(%)" not in tags

    def values(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert values("loss_metrics/global_avg_loss") == [(1, 3.0), (5, 2.0)]
    assert values("grad_norm") == [(1, 0.25), (5, 1.25)]
    assert values("lr") == [(1, pytest.approx(1e-3)), (5, pytest.approx(5e-3))]
    assert values("throughput(tps)") == [(1, 2000.0), (5, 2000.0)]


def test_init_logger_is_idempotent_and_names_the_rank() -> None:
    from titan.log import init_logger, logger

    init_logger(0)
    init_logger(1)
    ours = [h for h in logger.handlers if getattr(h, "_titan_handler", False)]
    assert len(ours) == 1 and logger.level == logging.INFO
    record = logging.LogRecord("titan", logging.INFO, __file__, 1, "hello", None, None)
    text = ours[0].format(record)
    assert re.match(r"^\[titan\] \[rank 1\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - INFO - hello$", text)
    init_logger(0)
    assert ours[0].format(record).startswith("[titan] 2")
