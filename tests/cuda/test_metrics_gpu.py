"""The metric columns on a GPU: tokens/s, TFLOP/s, MFU and memory are there and plausible."""

import pytest
import torch

from tests.cuda._common import metric_rows, train
from titan.training.flops import get_peak_flops

pytestmark = pytest.mark.cuda


def test_tps_mfu_memory_columns_are_sane(tmp_path, caplog):
    with caplog.at_level("INFO", logger="titan"):
        _, trainer = train(tmp_path, 4, "--training.mixed_precision_param", "bfloat16")
    rows = metric_rows(tmp_path)
    capacity_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    peak = get_peak_flops(torch.cuda.get_device_name(0))
    for row in rows.values():
        assert row["throughput(tps)"] > 0 and row["tflops"] > 0, row
        assert 0 < row["memory/max_reserved(GiB)"] < capacity_gib, row
        assert 0 < row["memory/max_active(GiB)"] <= row["memory/max_reserved(GiB)"], row
        assert 0 < row["memory/max_reserved(%)"] < 100, row
        if peak is None:  # a GPU missing from titan/training/flops.py: MFU is n/a, not made up
            assert "mfu(%)" not in row
        else:
            assert 0 < row["mfu(%)"] < 100, row
            assert row["mfu(%)"] == pytest.approx(100 * row["tflops"] * 1e12 / peak, rel=1e-6)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step:")]
    assert len(lines) == 4 and all("memory:" in line and "tps:" in line and "mfu:" in line for line in lines)
    if peak is not None:
        assert "mfu: n/a" not in lines[-1]
    assert trainer.metrics.device_name == torch.cuda.get_device_name(0)
