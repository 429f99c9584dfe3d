from __future__ import annotations

import re

import pytest

from titan.training.flops import get_peak_flops, mfu, transformer_flops_per_token


@pytest.mark.parametrize(
    "name, bf16, fp8",
    [
        ("NVIDIA H100 80GB HBM3", 989e12, 1979e12),
        ("NVIDIA H100 PCIe", 756e12, 1513e12),
        ("NVIDIA H100 NVL", 835e12, 1670e12),
        ("NVIDIA H200", 989e12, 1979e12),
        ("NVIDIA H200 NVL", 835e12, 1670e12),
        ("NVIDIA GH200 480GB", 989e12, 1979e12),
        ("NVIDIA A100-SXM4-80GB", 312e12, 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12, 312e12),
        ("NVIDIA A10G", 125e12, 125e12),
        ("NVIDIA A10", 125e12, 125e12),
        ("NVIDIA L40S", 362e12, 733e12),
        ("NVIDIA L4", 121e12, 242e12),
        ("NVIDIA B200", 2250e12, 4500e12),
        ("Tesla V100-SXM2-32GB", 125e12, 125e12),
        ("AMD Instinct MI300X", 1307e12, 2615e12),
        ("AMD Instinct MI325X", 1307e12, 2615e12),
    ],
)
def test_peak_flops_for_real_device_names(name: str, bf16: float, fp8: float) -> None:
    assert get_peak_flops(name) == bf16
    assert get_peak_flops(name, float8=True) == fp8


@pytest.mark.parametrize("name", ["cpu", "", "NVIDIA GeForce GTX 1080", "Intel Data Center GPU"])
def test_unknown_devices_have_no_peak(name: str) -> None:
    assert get_peak_flops(name) is None
    assert get_peak_flops(name, float8=True) is None


def test_llama3_8b_mfu_on_h100() -> None:
    # Llama 3 8B: dim 4096, 32 layers, 32 heads (8 KV heads, head_dim 128), ffn 14336,
    # vocab 128256; count every weight except the input embedding.
    dim, layers, heads, kv_dim, ffn, vocab, seq = 4096, 32, 32, 1024, 14336, 128256, 8192
    per_layer = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn + 2 * dim
    params = layers * per_layer + dim + dim * vocab
    assert params == 7_504_924_672
    flops = transformer_flops_per_token(params, layers, heads, dim // heads, seq)
    assert flops == 6 * 7_504_924_672 + 12 * 32 * 32 * 128 * 8192 == 57_914_449_920
    peak = get_peak_flops("NVIDIA H100 80GB HBM3")
    # 7,166 tok/s/GPU * 57.91 GFLOP/token = 415.0 TFLOP/s = 41.96 % of 989 TFLOP/s.
    assert mfu(7166, flops, peak) == pytest.approx(41.963, abs=1e-3)


def test_mfu_rejects_bad_peak() -> None:
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0)


def _fake_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """MetricsProcessor on a 'cuda' device without one: the name and memory queries it makes."""
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2**30)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=80 * 2**30)
    )


@pytest.mark.parametrize("float8", [False, True])
def test_float8_runs_report_mfu_against_the_bf16_peak(tmp_path, monkeypatch, caplog, float8: bool) -> None:
    """mfu is comparable across float8 and bf16 runs (bf16 peak, torchtitan's convention); float8 runs
    add mfu_float8 against the float8 peak, and the start-up log says which peak is which."""
    import logging

    import torch

    from titan.config.job_config import Job, JobConfig, Metrics
    from titan.training.metrics import MetricsProcessor, strip_color

    _fake_h100(monkeypatch)
    cfg = JobConfig(job=Job(dump_folder=str(tmp_path)), metrics=Metrics(disable_color_printing=True))
    with caplog.at_level(logging.INFO, logger="titan"):
        mp = MetricsProcessor(
            cfg.metrics,
            dump_folder=cfg.job.dump_folder,
            rank=0,
            device=torch.device("cuda"),
            num_flops_per_token=10**9,
            float8=float8,
        )
        mp.count_tokens(989_000)  # 989 TFLOP/s of work per second of wall time, if it took 1 s
        mp._last_time -= 1.0 - 1e-9
        scalars = mp.log(1, loss=1.0, grad_norm=1.0, lr=1e-4)
    text = "\n".join(strip_color(r.getMessage()) for r in caplog.records)
    assert "mfu is against the bf16 peak of NVIDIA H100 80GB HBM3, 989 TFLOP/s" in text
    assert scalars["mfu(%)"] == pytest.approx(100.0, rel=1e-3)
    if float8:
        assert "mfu_float8 against its float8 peak, 1,979 TFLOP/s" in text
        assert scalars["mfu_float8(%)"] == pytest.approx(100.0 * 989 / 1979, rel=1e-3)
        assert re.search(r"mfu: 100\.0\d%  mfu_float8: 49\.9\d%", text)
    else:
        assert "mfu_float8" not in text and "mfu_float8(%)" not in scalars
