"""scripts/benchmark.py: a config per fresh process, one table row each; named GPU configs and presets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import cpu_env

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import benchmark
finally:
    sys.path.pop(0)


def _bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts/benchmark.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_benchmark_table_has_a_row_per_variant():
    proc = _bench(
        "--steps",
        "3",
        "--warmup",
        "1",
        "--variant",
        "eager=",
        "--variant",
        "typo=--activation_checkpoint.mode partial",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and "config" not in line
    }
    assert rows.keys() == {"eager", "typo"}
    step_ms, _, tps, ratio, tflops, mfu, mem, loss = rows["eager"]
    assert float(step_ms) > 0 and float(tps.replace(",", "")) > 0 and ratio == "1.00x" and float(tflops) >= 0
    assert mfu == "n/a"  # no peak FLOP/s for a CPU: not made up
    assert float(mem.replace(",", "")) > 0 and 5 < float(loss) < 9  # ln(2048) = 7.6 at the start
    # tokens/s and step time are the same measurement, each rounded as printed (0.1 ms, 1 token/s)
    printed_tps, printed_ms = float(tps.replace(",", "")), float(step_ms)
    rounding = 0.05 / printed_ms + 0.5 / printed_tps
    assert printed_tps == pytest.approx(2 * 32 / (printed_ms / 1000), rel=1.01 * rounding)
    assert rows["typo"][0] == "failed" and "activation_checkpoint.mode" in proc.stderr
    assert "1 warm-up + 3 timed steps" in proc.stdout and "device: cpu x 1" in proc.stdout


def test_bad_preset_or_config_name_is_one_line():
    proc = _bench("--preset", "llama3_8b_9layers")
    assert (
        proc.returncode == 2
        and "benchmark: error: --preset got 'llama3_8b_9layers'; valid: llama3_8b_8layers" in proc.stderr
    ), proc.stderr
    proc = _bench("--only", "eager,compiled")
    assert proc.returncode == 2 and "--only got 'compiled'; valid: eager, compile" in proc.stderr, proc.stderr


def test_gpu_config_set_names_the_performance_doc_rows():
    names = [n for n, _ in benchmark.default_configs(cuda=True)]
    # No float8 hardware here: the float8 rows say they are emulated.
    assert names == [
        "eager",
        "compile",
        "float8-tensorwise (emulated)",
        "float8-rowwise (emulated)",
        "ac-none",
        "ac-selective",
        "ac-full",
        "flex",
    ]
    assert [n for n, _ in benchmark.default_configs(cuda=False)][-1] == "float8 (emulated)"


def test_the_benchmark_preset_is_a_valid_config():
    from titan.training.checks import load_job

    preset = benchmark.PRESETS["llama3_8b_8layers"]
    config = load_job(preset["args"])
    assert (config.training.seq_len, config.training.local_batch_size, config.model.n_layers) == (8192, 1, 8)
    assert (preset["warmup"], preset["steps"]) == (10, 20)  # medians over steps 11-30
    for _, extra in benchmark.GPU_CONFIGS:
        load_job(preset["args"] + extra.split())
