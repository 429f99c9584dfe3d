"""A tiny llama4 (MoE every second block) through train.py on one process: the loss falls, the
routing statistics reach the console and the JSONL file, and a resume from a DCP checkpoint
continues the uninterrupted run's curve exactly (the balancing biases are checkpointed)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.runs import train_subprocess

pytestmark = pytest.mark.slow
# debugmodel cut to 2 blocks of width 64: block 1 is an MoE block (8 experts, top 1, a shared expert).
TINY_LLAMA4 = ["--model.name", "llama4", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4"]
RUN = [
    *TINY_LLAMA4,
    *("--training.steps", "16", "--lr_scheduler.warmup_steps", "2", "--training.local_batch_size", "4"),
    *("--checkpoint.interval", "8", "--metrics.enable_jsonl"),
]


def _jsonl(folder) -> dict[int, dict]:
    """step -> every scalar written for it (a step may have several records)."""
    [path] = (folder / "metrics").glob("*.jsonl")
    out: dict[int, dict] = {}
    for record in map(json.loads, path.read_text().splitlines()):
        out.setdefault(record["step"], {}).update(record)
    return out


def test_llama4_trains_and_resumes_exactly(tmp_path):
    rc, out, losses = train_subprocess(tmp_path / "ref", *RUN)
    assert rc == 0, out[-3000:]
    assert sorted(losses) == list(range(1, 17))
    first, last = (sum(float(losses[s]) for s in steps) / 3 for steps in ((1, 2, 3), (14, 15, 16)))
    assert last < first - 0.3, losses
    assert "moe_max_load:" in out and "moe_layers/" not in out  # per-layer detail: files only
    ref = _jsonl(tmp_path / "ref")
    assert ref[16]["moe_layers/layers.1.moe/tokens_max_over_mean"] >= 1.0
    assert ref[16]["moe_layers/layers.1.moe/padded_fraction"] == 0.0  # CPU grouped GEMM: no padding

    # The same run stopped after its step-8 save, then resumed to step 16.
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    shutil.rmtree(tmp_path / "run/checkpoint/step-16")
    shutil.rmtree(tmp_path / "run/metrics")
    rc, out, resumed = train_subprocess(tmp_path / "run", *RUN)
    assert rc == 0, out[-3000:]
    assert sorted(resumed) == list(range(9, 17))
    again = _jsonl(tmp_path / "run")
    for step in range(9, 17):  # bitwise: the JSONL holds the full float
        assert again[step]["loss_metrics/global_avg_loss"] == ref[step]["loss_metrics/global_avg_loss"], step


def _two_rank_biases(rank: int, world: int, tmp: str) -> dict[str, tuple[float, dict]]:
    from pathlib import Path

    from tests.helpers.runs import trainer

    out = {}
    for dtype in ("float32", "bfloat16"):
        flags = ("--training.steps", "3", "--metrics.log_freq", "3", "--training.mixed_precision_param", dtype)
        t = trainer(Path(tmp) / dtype, *TINY_LLAMA4, *flags)
        losses = t.train()
        out[dtype] = losses[3], {name: m.expert_bias.clone() for name, m in t.moe_monitor.layers}
        del t
    return out


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> list[dict]:
    """Both dtypes' runs on one spawned process group."""
    from tests.helpers.distributed import run_distributed

    return run_distributed(_two_rank_biases, 2, str(tmp_path_factory.mktemp("biases")), timeout=300)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_rank_fsdp_keeps_the_balancing_biases_identical(two_rank_runs, dtype):
    """Each rank routes its own tokens; the bias update sums the counts over the data-parallel ranks,
    so every rank moves its biases the same way (a buffer FSDP does not synchronise), in float32
    and in bfloat16 parameters."""
    (loss0, bias0), (loss1, bias1) = (per_rank[dtype] for per_rank in two_rank_runs)
    assert loss0 == loss1 and list(bias0) == ["layers.1.moe"]
    assert torch.equal(bias0["layers.1.moe"], bias1["layers.1.moe"])
    assert bias0["layers.1.moe"].abs().sum() > 0
