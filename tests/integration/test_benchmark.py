"""scripts/benchmark.py end to end: a variant per fresh process, one table row each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_table_has_a_row_per_variant():
    cmd = [
        sys.executable, str(REPO / "scripts/benchmark.py"), "--steps", "2", "--warmup", "1",
        "--variant", "eager=", "--variant", "typo=--activation_checkpoint.mode partial",
        "--training.seq_len", "32", "--training.local_batch_size", "2",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and "variant" not in line}
    assert rows.keys() == {"eager", "typo"}
    step_ms, _, tps, ratio, mem, loss = rows["eager"]
    assert float(step_ms) > 0 and float(tps.replace(",", "")) > 0 and ratio == "1.00x"
    assert float(mem.replace(",", "")) > 0 and 5 < float(loss) < 9  # ln(2048) = 7.6 at the start
    assert rows["typo"][0] == "failed" and "activation_checkpoint.mode" in proc.stderr
