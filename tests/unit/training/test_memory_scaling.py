"""Nothing a rank holds of the model's state grows with the whole model: when the ranks double at a
fixed layout of the other dimensions, each rank's parameters and optimizer state halve (within 5%:
FSDP pads dim 0 to the shard count and replicates nothing but TP's norms). Counted on the model as
the trainer builds it, on meta in a fake world (titan/training/memory/layout.py), for every layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan.config import load_config
from titan.training.memory.layout import build_rank
from titan.training.memory.optimizer import optimizer_bytes
from titan.training.plan import plan_run

REPO = Path(__file__).resolve().parents[3]

_LAYOUTS = {
    "fsdp": ("debug_model.toml", 4, ()),
    "fsdp x tp": ("debug_model.toml", 8, ("--parallelism.tensor_parallel_degree", "2")),
    "pp x fsdp": ("debug_model.toml", 8, ("--parallelism.pipeline_parallel_degree", "2")),
    "hsdp": ("debug_model.toml", 8, ("--parallelism.data_parallel_replicate_degree", "2")),
    "fsdp x ep": ("llama4_debug.toml", 8, ("--parallelism.expert_parallel_degree", "2")),
    # more FSDP ranks than the 8 experts, no EP: the experts' hidden dim is sharded, not dim 0
    "fsdp > experts": ("llama4_debug.toml", 16, ()),
    "muon": ("debug_model.toml", 4, ("--optimizer.name", "Muon")),
}


def _state_bytes(file: str, world: int, extra: tuple[str, ...]) -> tuple[int, int]:
    """(parameter bytes, optimizer state bytes) of rank 0 of ``world`` ranks."""
    config = load_config(
        ["--job.config_file", str(REPO / "train_configs" / file), "--training.local_batch_size", "8", *extra]
    )
    plan = plan_run(config, world, "cuda", data_here=False)
    rank = build_rank(config, plan, 0)
    return rank.total("held"), optimizer_bytes(rank, config)[0]


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_per_rank_parameters_and_optimizer_state_halve_when_ranks_double(layout):
    file, world, extra = _LAYOUTS[layout]
    params, state = _state_bytes(file, world, extra)
    params2, state2 = _state_bytes(file, 2 * world, extra)
    assert params2 == pytest.approx(params / 2, rel=0.05), (params, params2)
    assert state2 == pytest.approx(state / 2, rel=0.05), (state, state2)
