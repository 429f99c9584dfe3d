"""scripts/plot_metrics.py reads titan's TensorBoard folder (one subfolder per run) and JSONL files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.runs import script_module

REPO = Path(__file__).resolve().parents[3]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def plot_metrics():
    return script_module("plot_metrics")


def _tb_run(folder: Path, losses: list[float]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder))
    for step, loss in enumerate(losses, 1):
        writer.add_scalar("loss_metrics/global_avg_loss", loss, step)
        writer.add_scalar("lr", 1e-3, step)
    writer.close()


def test_tensorboard_folder_with_run_subfolders(tmp_path, plot_metrics, capsys):
    pytest.importorskip("matplotlib")
    tb = tmp_path / "outputs" / "tb"  # as the trainer writes it: <dump_folder>/tb/<run stamp>/
    _tb_run(tb / "20250101-120000", [8.0, 7.0, 6.5])
    _tb_run(tb / "20250102-090000", [8.1, 6.0])
    runs = plot_metrics.read_runs(tb)
    assert sorted(Path(k).name for k in runs) == ["20250101-120000", "20250102-090000"]
    first = runs[str(tb / "20250101-120000")]
    assert [v for _, v in first["loss_metrics/global_avg_loss"]] == pytest.approx([8.0, 7.0, 6.5])
    assert [s for s, _ in first["lr"]] == [1, 2, 3]
    out = tmp_path / "tb.png"
    assert plot_metrics.main([str(tb), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and "loss, lr" in capsys.readouterr().out
    # One run's folder, and one event file, work as well.
    assert list(plot_metrics.read_runs(tb / "20250102-090000")) == [str(tb / "20250102-090000")]
    event = next((tb / "20250102-090000").glob("events.out.tfevents*"))
    assert [v for _, v in plot_metrics.read_runs(event)[str(event)]["loss_metrics/global_avg_loss"]] == pytest.approx(
        [8.1, 6.0]
    )


def test_jsonl_file_and_folder(tmp_path, plot_metrics):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "metrics"
    folder.mkdir()
    rows = [
        {"step": 1, "loss_metrics/global_avg_loss": 8.0, "grad_norm": 2.0},
        {"step": 2, "loss_metrics/global_avg_loss": 7.5, "grad_norm": 1.5},
    ]
    (folder / "a.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo'
    )  # partial last line
    (folder / "b.jsonl").write_text(json.dumps(rows[0]) + "\n")
    runs = plot_metrics.read_runs(folder)
    assert runs[str(folder / "a.jsonl")]["grad_norm"] == [(1, 2.0), (2, 1.5)]
    assert len(runs) == 2
    assert plot_metrics.main([str(folder / "a.jsonl"), str(folder / "b.jsonl"), "-o", str(tmp_path / "j.png")]) == 0
    assert (tmp_path / "j.png").read_bytes()[:8] == PNG


def test_folder_without_metrics_is_one_error_line(tmp_path, plot_metrics, capsys):
    (tmp_path / "empty").mkdir()
    for arg in ("empty", "missing"):
        with pytest.raises(SystemExit) as e:
            plot_metrics.main([str(tmp_path / arg), "-o", str(tmp_path / "x.png")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("titan: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "x.png").exists()
