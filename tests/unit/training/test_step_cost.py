"""Per-step cost of the training loop: host syncs, whole-model passes, checkpoint time.

A GPU run pays for every host read of a device value (the CPU waits for the GPU, the GPU then idles
while the CPU launches the next kernels) and for every extra pass over all weights. Counted here on
CPU by wrapping the calls that would sync, and torch._foreach_norm (one whole-model pass each).
"""

import json
from pathlib import Path

import pytest
import torch

from titan.checkpointing.manager import CheckpointManager
from titan.config import load_config
from titan.training.metrics import MetricsProcessor
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
TITAN = REPO / "titan"
# Host-side by construction (tokens are made on the CPU before .to(device)): not device syncs.
HOST_ONLY = (TITAN / "data",)
SYNCING = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def _config(dump: Path, *extra: str):
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(dump),
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.disable_color_printing",
            *extra,
        ]
    )


def _count_per_step(monkeypatch, trainer: Trainer) -> tuple[dict[int, int], dict[int, int]]:
    """(host syncs issued from titan code, torch._foreach_norm calls), per training step."""
    syncs: dict[int, int] = {}
    norms: dict[int, int] = {}

    def from_titan(depth: int = 2) -> bool:
        import sys

        path = Path(sys._getframe(depth).f_code.co_filename)
        return TITAN in path.parents and not any(d in path.parents for d in HOST_ONLY)

    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, _original=original, **k):
            if from_titan():
                syncs[trainer.step] = syncs.get(trainer.step, 0) + 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    foreach_norm = torch._foreach_norm

    def counting_norm(*a, **k):
        norms[trainer.step] = norms.get(trainer.step, 0) + 1
        return foreach_norm(*a, **k)

    monkeypatch.setattr(torch, "_foreach_norm", counting_norm)
    return syncs, norms


def test_one_host_sync_and_one_model_pass_per_step_when_logging_every_step(tmp_path, monkeypatch):
    trainer = Trainer(
        _config(tmp_path, "--training.steps", "6", "--metrics.log_freq", "1", "--metrics.param_norm_freq", "4")
    )
    syncs, norms = _count_per_step(monkeypatch, trainer)
    losses = trainer.train()
    assert sorted(losses) == list(range(1, 7))
    # The non-finite check is the step's one read; logging reuses what it read (param_norm too).
    assert syncs == {s: 1 for s in range(1, 7)}, syncs
    # The grad norm is the one whole-model pass; param_norm adds one on step 1 and step 4 only.
    assert norms == {1: 2, 2: 1, 3: 1, 4: 2, 5: 1, 6: 1}, norms
    rows = [json.loads(line) for f in (tmp_path / "metrics").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert [r["step"] for r in rows if "param_norm" in r] == [1, 4]
    assert all(
        r["param_norm"] > 0 and r["loss_metrics/global_avg_loss"] == losses[r["step"]]
        for r in rows
        if "param_norm" in r
    )


def test_param_norm_freq_zero_turns_it_off_and_a_step_that_logs_nothing_reads_nothing(tmp_path, monkeypatch):
    trainer = Trainer(
        _config(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2", "--metrics.param_norm_freq", "0")
    )
    syncs, norms = _count_per_step(monkeypatch, trainer)
    trainer.train()
    assert norms == {1: 1, 2: 1, 3: 1, 4: 1}
    assert syncs == {1: 1, 2: 1, 4: 1}, syncs  # step 3 logs nothing: the non-finite check stays on the device


class _Clock:
    """perf_counter for the trainer and the metrics: 1 ms per reading, plus what ``sleep`` adds.
    The test then measures the accounting, not the machine's load."""

    def __init__(self) -> None:
        self.t = 0.0

    def perf_counter(self) -> float:
        self.t += 0.001
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_checkpoint_save_time_is_not_in_tokens_per_second(tmp_path, monkeypatch):
    import titan.training.metrics
    import titan.training.trainer

    pause = 1.5
    clock = _Clock()
    monkeypatch.setattr(titan.training.trainer, "time", clock)
    monkeypatch.setattr(titan.training.metrics, "time", clock)
    original = CheckpointManager.save

    def slow_save(self, step, **kwargs):  # a slow disk
        clock.sleep(pause)
        return original(self, step, **kwargs)

    monkeypatch.setattr(CheckpointManager, "save", slow_save)
    log_times: dict[int, float] = {}
    log = MetricsProcessor.log

    def timed_log(self, step, **kwargs):
        log_times[step] = clock.perf_counter()
        return log(self, step, **kwargs)

    monkeypatch.setattr(MetricsProcessor, "log", timed_log)
    trainer = Trainer(
        _config(
            tmp_path,
            "--training.steps",
            "4",
            "--metrics.log_freq",
            "1",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            "--checkpoint.async_mode",
            "disabled",
        )
    )
    trainer.train()
    [jsonl] = (tmp_path / "metrics").glob("*.jsonl")
    rows = {r["step"]: r for r in map(json.loads, jsonl.read_text().splitlines()) if "throughput(tps)" in r}
    # The save after step 2 comes before step 2's line, in its window: its time is reported there,
    # not charged to the step (the window's time = the step's time + the checkpoint time).
    window = log_times[2] - log_times[1]
    ckpt, step_s = rows[2]["time_metrics/checkpoint(s)"], rows[2]["time_metrics/end_to_end(s)"]
    assert ckpt >= pause and step_s < 0.5 and step_s + ckpt == pytest.approx(window, abs=1e-9), (ckpt, step_s, window)
    assert rows[2]["throughput(tps)"] == pytest.approx(2 * 32 / step_s, rel=1e-3)
    assert rows[3]["time_metrics/checkpoint(s)"] < pause / 10 and rows[4]["time_metrics/checkpoint(s)"] < pause / 10
    assert (tmp_path / "checkpoint").is_dir()


@pytest.mark.parametrize("log_freq", [1, 5])
def test_metrics_console_names_the_checkpoint_time(tmp_path, caplog, log_freq):
    config = _config(tmp_path, "--metrics.log_freq", str(log_freq), "--metrics.enable_jsonl", "false")
    m = MetricsProcessor(
        config.metrics, dump_folder=config.job.dump_folder, rank=0, device=torch.device("cpu"), num_flops_per_token=1
    )
    m.count_tokens(100)
    m.add_checkpoint_time(0.5)
    with caplog.at_level("INFO", logger="titan"):
        scalars = m.log(5, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert scalars["time_metrics/checkpoint(s)"] == 0.5
    assert "checkpoint: 0.50s (not in tps)" in caplog.text
    assert m.log(10, loss=1.0, grad_norm=1.0, lr=1e-3)["time_metrics/checkpoint(s)"] == 0.0
