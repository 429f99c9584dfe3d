"""Activation checkpointing under compile: memory_budget through the min-cut partitioner, and a
checkpointed tensor-parallel block (the layout of torchtitan's 2d_compile case)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch._functorch.config as functorch_config

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import TINY, build, train_losses
from titan.config import load_config
from titan.models.llama.parallelize import parallelize_llama
from titan.parallel.compile import is_compiled
from titan.parallel.dims import ParallelDims

ONE_LAYER = replace(TINY, n_layers=1)


@pytest.mark.slow
def test_memory_budget_trains_like_no_checkpointing(tmp_path, monkeypatch):
    # One cold inductor compile of one block (forward + backward); the loss stays eager.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for key in ("activation_memory_budget", "visualize_memory_budget_pareto", "memory_budget_pareto_dir"):
        monkeypatch.setattr(functorch_config, key, getattr(functorch_config, key))
    cfg = load_config(
        [
            *("--compile.enable", "--compile.components", "model"),
            *("--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.5"),
            *("--activation_checkpoint.visualize_memory_budget_pareto", "--job.dump_folder", str(tmp_path)),
        ]
    )
    model = build(ONE_LAYER)
    parallelize_llama(model, ParallelDims(1, 1, 1, 1, 1, world_size=1), cfg)
    assert functorch_config.activation_memory_budget == 0.5
    assert all(is_compiled(b) for b in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in build(ONE_LAYER).named_parameters()]
    got = train_losses(model, 3)
    ref = train_losses(build(ONE_LAYER), 3)
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, (got, ref)
    # The partitioner drew its runtime-vs-memory curve of the block's graph.
    assert list((tmp_path / "memory_budget_pareto").glob("memory_budget_pareto*.svg"))


def _tp_compiled_full_ac(rank: int, world: int, cache: str, keep_attention: bool | None) -> tuple[list, list]:
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from titan.models.llama.parallelize import apply_tp
    from titan.parallel.ac import apply_ac, recomputed_attention_breaks_compile
    from titan.parallel.compile import apply_compile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = build(ONE_LAYER)
    apply_tp(ref, mesh, loss_parallel=False)
    model = build(ONE_LAYER)
    apply_tp(model, mesh, loss_parallel=False)
    if keep_attention is None:
        keep_attention = recomputed_attention_breaks_compile(mesh.device_type, tp_enabled=True, compiled=True)
    apply_ac(model, "full", compiled=True, keep_attention=keep_attention)
    apply_compile(model, before_blocks=model.tok_embeddings)
    return train_losses(model, 2), train_losses(ref, 2)


@pytest.mark.slow
def test_tensor_parallel_compiled_checkpointed_block_trains(tmp_path):
    # One rank is enough: the DTensor block saves its DeviceMesh for backward at any TP degree.
    got, ref = run_distributed(_tp_compiled_full_ac, 1, str(tmp_path / "inductor"), None)[0]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4, (got, ref)
