"""Memory estimate of an MoE model: every expert's parameters are stored (and sharded by FSDP), and
the fake-tensor forward/backward allocates what the real one does."""

from __future__ import annotations

import copy

import pytest
import torch

import titan.models
from titan.config import load_config
from titan.models import register_flavor
from titan.models.llama4 import Llama4ModelArgs, Llama4Transformer
from titan.models.moe import MoEArgs
from titan.training.loss import cross_entropy_sum
from titan.training.memory import LiveBytes, estimate_memory

TINY = Llama4ModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, multiple_of=32, max_seq_len=32,
    moe_args=MoEArgs(num_experts=4, top_k=2),
)  # fmt: skip


@pytest.fixture
def tiny_llama4(monkeypatch):
    specs = titan.models._REGISTRY.specs()
    monkeypatch.setitem(specs, "llama4", specs["llama4"])  # restored at teardown
    register_flavor("llama4", "tiny", TINY, replace=True)


def _cfg(*extra: str):
    return load_config(
        ["--model.name", "llama4", "--model.flavor", "tiny", "--training.seq_len", "32"]
        + ["--training.local_batch_size", "4", "--training.mixed_precision_param", "float32", *extra]
    )


def test_all_experts_are_stored_and_sharded(tiny_llama4):
    model = Llama4Transformer(copy.deepcopy(TINY))
    stored = sum(p.numel() for p in model.parameters())
    experts = model.layers["1"].moe.experts
    assert experts.w1.numel() == 4 * TINY.moe_hidden_dim * 64  # all four experts
    assert estimate_memory(_cfg(), 1).params == stored
    assert estimate_memory(_cfg("--parallelism.data_parallel_shard_degree", "2"), 2).params == pytest.approx(
        stored / 2, rel=0.02
    )


def test_fake_peak_equals_real_peak_with_moe_layers(tiny_llama4):
    est = estimate_memory(_cfg(), 1).activation_bytes
    torch.manual_seed(0)
    model = Llama4Transformer(copy.deepcopy(TINY))
    model.init_weights()
    tokens = torch.randint(0, TINY.vocab_size, (4, 33))
    tracker = LiveBytes()
    tracker.ignore([*model.parameters(), *model.buffers(), tokens])
    with tracker:
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert est == pytest.approx(tracker.peak, rel=1e-3)
