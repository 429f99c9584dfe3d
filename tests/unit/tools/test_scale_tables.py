"""scripts/scale_tables.py keeps the global batch fixed as the ranks double and renders what ran."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import script_module

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def scale_tables():
    return script_module("scale_tables")


def _value(args: list[str], key: str) -> str:
    return args[args.index(key) + 1]


def test_local_batch_halves_as_ranks_double(scale_tables):
    for n in (64, 128, 4096):
        args = scale_tables._args("llama3_405b", n, "Muon")
        dp = n // 8  # TP 8
        assert _value(args, "--world_size") == str(n)
        assert _value(args, "--optimizer.name") == "Muon"
        assert int(_value(args, "--training.local_batch_size")) * dp == 512
        assert _value(args, "--training.global_batch_size") == "512"


def _row(n: int, total: int) -> dict:
    cats = dict.fromkeys(["parameters", "gradients", "optimizer_state", "optimizer_aux", "activations"], 0)
    sim = {**cats, "communication": 0, "loss": 0, "parameters": total, "total": total}
    return {
        "case": "llama3_405b",
        "optimizer": "AdamW",
        "local_batch": 512 // (n // 8),
        "world_size": n,
        "simulated_peak_bytes": sim,
        "estimate_bytes": {"total": None},
        "collectives": {"all_gather": {"count": 3, "bytes": 2 * 1024**3}},
        "layers_run": [3, 4],
        "extrapolated": True,
    }


def test_table_and_chart_from_results(tmp_path, scale_tables):
    rows = [_row(128, 2 * 1024**3), _row(64, 4 * 1024**3)]
    text = scale_tables.table(rows)
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines[1].startswith("| 64 | 64 | 4.0 |") and "| **4.0** | n/a | 2.0 |" in lines[1]
    assert lines[2].startswith("| 128 | 32 | 2.0 |")
    assert "extrapolated from runs of 3 and 4 blocks" in text
    pytest.importorskip("matplotlib")
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "g.png"
    assert scale_tables.main(["chart", "--results", str(results), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG)
