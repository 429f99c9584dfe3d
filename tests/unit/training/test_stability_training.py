"""The trainer with stability, validation, profiling and metric files switched on (1 process).

One 12-step run checks several things at once (each Trainer costs seconds on 2 cores): an
injected gradient spike is detected and counted, validation loss falls, the profiler writes
traces, TensorBoard / JSONL hold the scalars and scripts/plot_metrics.py draws them.
"""

import json
import math
from pathlib import Path

import pytest
import torch

import train as train_entry
from tests.helpers.inject import Inject
from tests.helpers.runs import script_module
from titan.config import load_config
from titan.errors import TitanError
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--metrics.disable_color_printing",
    "--lr_scheduler.warmup_steps",
    "2",
]


def _args(dump: Path, *extra: str) -> list[str]:
    return [
        "--job.config_file",
        str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder",
        str(dump),
        *TINY,
        *extra,
    ]


def _config(dump: Path, *extra: str):
    return load_config(_args(dump, *extra))


def _full(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model_parts[0].named_parameters()}


@pytest.mark.slow
def test_spike_validation_profiler_and_metric_files(tmp_path, monkeypatch):
    Inject(monkeypatch, {9}, grad_scale=100.0)
    config = _config(
        tmp_path,
        "--training.steps",
        "12",
        "--training.dataset",
        "pydoc_train",
        "--stability.grad_norm_spike_window",
        "4",
        "--stability.grad_norm_spike_threshold",
        "5",
        "--model.depth_init",
        "false",
        "--validation.enable",
        "--validation.freq",
        "6",
        "--validation.steps",
        "4",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "6",
        "--profiling.warmup_steps",
        "1",
        "--metrics.enable_tensorboard",
        "--optimizer.weight_decay_exclude",
        "norms,embeddings",
    )
    trainer = Trainer(config)

    # depth_init = false: every block's output projections use 0.02 / sqrt(2 * n_layers).
    layers = trainer.model_parts[0].layers
    expected = 0.02 / math.sqrt(2 * len(layers))
    for lid in ("0", str(len(layers) - 1)):
        assert layers[lid].attention.wo.weight.std().item() == pytest.approx(expected, rel=0.05)
    # weight_decay_exclude: norms and embeddings sit in a weight-decay-0 group
    [opt] = trainer.optimizers.optimizers
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    model = trainer.model_parts[0]
    assert id(model.tok_embeddings.weight) in no_decay and id(model.norm.weight) in no_decay
    assert id(layers["0"].attention_norm.weight) in no_decay and id(model.output.weight) not in no_decay

    losses = trainer.train()

    gn = trainer.stability.grad_norm
    assert (gn.events, gn.spike_steps, gn.durations) == (1, 1, [1]), (gn.events, gn.durations)
    assert all(math.isfinite(v) for v in losses.values())

    # validation at 6 and 12 on held-out topics: the loss falls
    val = trainer.validator.history
    assert sorted(val) == [6, 12] and val[12] < val[6] - 0.1, val

    # profiler: one trace per window
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "profile_traces").rglob("*.json"))
    assert traces == ["profile_traces/iteration_12/rank0_trace.json", "profile_traces/iteration_6/rank0_trace.json"]
    assert json.loads((tmp_path / traces[0]).read_text())["traceEvents"]

    # JSONL: one line per logged step plus validation lines; the spike is counted from step 9
    [jsonl] = (tmp_path / "metrics").glob("*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    train_rows = {r["step"]: r for r in rows if "grad_norm" in r}
    assert sorted(train_rows) == list(range(1, 13))
    assert [train_rows[s]["stability/grad_norm_spikes"] for s in (8, 9, 12)] == [0.0, 1.0, 1.0]
    assert train_rows[9]["grad_norm"] > 20 * train_rows[8]["grad_norm"]
    assert [r["validation/loss"] for r in rows if "validation/loss" in r] == [val[6], val[12]]

    # TensorBoard, read back with tensorboard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [tb_dir] = (tmp_path / "tb").iterdir()
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "loss_metrics/global_avg_loss",
        "grad_norm",
        "lr",
        "throughput(tps)",
        "param_norm",
        "stability/grad_norm_spikes",
        "validation/loss",
        "validation/perplexity",
    ):
        assert tag in tags, (tag, sorted(tags))
    tb_loss = {e.step: e.value for e in acc.Scalars("loss_metrics/global_avg_loss")}
    assert tb_loss == pytest.approx(losses)
    assert [e.value for e in acc.Scalars("stability/grad_norm_spikes")][-1] == 1.0

    # scripts/plot_metrics.py draws PNGs from both sources
    pytest.importorskip("matplotlib")
    plot_metrics = script_module("plot_metrics")
    for src, name in ((jsonl, "a.png"), (tb_dir, "b.png")):
        assert plot_metrics.main([str(src), "-o", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nan_stop_exits_nonzero_with_step_and_metric(tmp_path, monkeypatch, capsys):
    Inject(monkeypatch, {3}, output_nan=True)
    code = train_entry.main(_args(tmp_path, "--training.steps", "5", "--training.nonfinite", "stop"))
    err = capsys.readouterr().err
    assert code == 2
    assert "titan: error: non-finite loss = nan, grad_norm = nan at step 3 (training.nonfinite = stop)" in err, err
    # no loss was logged (nor would be saved) for the failing step; the attempt's goodput record may name it
    [jsonl] = (tmp_path / "metrics").glob("*.jsonl")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["step"] for r in records if "loss_metrics/global_avg_loss" in r] == [1, 2]
    assert all(set(r) <= {"step"} | {k for k in r if k.startswith("goodput/")} for r in records if r["step"] == 3)


def test_nan_skip_step_leaves_weights_and_advances_lr(tmp_path, monkeypatch):
    Inject(monkeypatch, {3}, grad_scale=math.nan)
    trainer = Trainer(_config(tmp_path, "--training.steps", "5", "--training.nonfinite", "skip_step"))
    snapshots = {}
    original = Trainer.train_step  # the injecting wrapper

    def record(self, mbs):
        snapshots[self.step] = _full(self)
        return original(self, mbs)

    monkeypatch.setattr(Trainer, "train_step", record)
    losses = trainer.train()
    after_3 = snapshots[4]
    assert all(torch.equal(after_3[k], v) for k, v in snapshots[3].items()), "step 3 changed the weights"
    assert not torch.equal(snapshots[3]["output.weight"], snapshots[2]["output.weight"])
    [opt] = trainer.optimizers.optimizers
    assert {int(s["step"]) for s in opt.state.values()} == {4}  # 5 steps, one skipped
    assert trainer.lr_schedulers.schedulers[0].last_epoch == 5  # the schedule kept going
    assert trainer.stability.skipped_steps == 1
    assert sorted(losses) == [1, 2, 3, 4, 5] and all(math.isfinite(v) for v in losses.values())


def test_too_many_consecutive_skips_stop(tmp_path, monkeypatch):
    Inject(monkeypatch, {2, 3, 4}, grad_scale=math.nan)
    trainer = Trainer(
        _config(
            tmp_path,
            "--training.steps",
            "5",
            "--training.nonfinite",
            "skip_step",
            "--training.nonfinite_max_consecutive_skips",
            "2",
        )
    )
    with pytest.raises(TitanError, match="grad_norm = nan at step 4: 3 consecutive steps skipped"):
        trainer.train()
