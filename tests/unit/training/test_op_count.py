"""Ops per training step, counted per transformer block: an op that comes back in every layer (a
k/v copy for grouped-query attention, a no-op cast per parameter) costs a launch per layer on a GPU
and host time in eager mode. Counted at the dispatcher (TorchDispatchMode: every aten op below
autograd, forward, backward and optimizer), so the counts are exact and need no timing. The
per-layer cost is the difference between the same step with 2 blocks and with 1.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.tiny import TINY
from titan.config import load_config
from titan.models.kv_cache import KVCache
from titan.models.llama.model import Transformer
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[3]

# One block's ops in a training step of the debug model (grouped-query heads; AdamW fused, the
# default where torch has the kernel, CPU included; clipping on, fp32, torch 2.13 on CPU): the
# budget each op may not exceed. Copies: the two clones are the attention output's .contiguous()
# before wo and its backward; k/v are never copied (SDPA reads the grouped heads itself). No
# _local_scalar_dense: the fused kernel keeps the step counters on the device (foreach AdamW reads
# each on the host, 2 per parameter, 18 per block).
PER_LAYER_BUDGET = {
    "aten.view": 41,
    "aten.t": 35,
    "aten.mul": 27,
    "aten.mm": 21,
    "aten.detach": 15,
    "aten.add": 9,
    "aten.transpose": 8,
    "aten._unsafe_view": 7,
    "aten.pow": 6,
    "aten.sum": 4,
    "aten.view_as_complex": 4,
    "aten.view_as_real": 4,
    "aten.mean": 2,
    "aten.add_": 2,
    "aten.rsqrt": 2,
    "aten.div": 2,
    "aten.expand": 2,
    "aten._conj": 2,
    "aten.clone": 2,
    "aten.slice": 1,
    "aten._scaled_dot_product_flash_attention_for_cpu": 1,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": 1,
    "aten.silu": 1,
    "aten.silu_backward": 1,
}
# What a copy of k/v to the query heads is made of (expand + a copying reshape, or repeat_interleave).
KV_COPY_OPS = ("aten.clone", "aten.repeat_interleave", "aten.expand", "aten.copy_")


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(tmp_path: Path, n_layers: int) -> Counter[str]:
    """The ops of the second training step (the first one also creates the optimizer state)."""
    config = load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            str(tmp_path / f"layers{n_layers}"),
            "--model.n_layers",
            str(n_layers),
            # Narrower than the debug model (the op counts do not depend on widths), 2 query heads per k/v head.
            "--model.dim",
            "64",
            "--model.n_heads",
            "4",
            "--model.n_kv_heads",
            "2",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "2",
            "--training.steps",
            "2",
            "--metrics.enable_tensorboard",
            "false",
        ]
    )
    trainer = Trainer(config)
    for step in (1, 2):
        microbatches = trainer.next_microbatches()
        assert microbatches is not None
        trainer.train_state.step = step
        if step == 2:
            with _CountOps() as counter:
                trainer.train_step(microbatches)
            return counter.ops
        trainer.train_step(microbatches)
    raise AssertionError("unreachable")


def _per_layer(one: Counter[str], two: Counter[str]) -> dict[str, int]:
    diff = Counter(two)
    diff.subtract(one)
    return {op: n for op, n in diff.items() if n}


def test_training_step_adds_no_op_per_layer_beyond_the_budget(tmp_path):
    per_layer = _per_layer(_step_ops(tmp_path, 1), _step_ops(tmp_path, 2))
    over = {op: (n, PER_LAYER_BUDGET.get(op, 0)) for op, n in per_layer.items() if n > PER_LAYER_BUDGET.get(op, 0)}
    assert not over, f"ops per layer over the budget (count, budget): {over}; all per layer: {per_layer}"
    assert sum(per_layer.values()) <= sum(PER_LAYER_BUDGET.values())


def _decode_ops(n_layers: int, prompt: torch.Tensor, chunk: torch.Tensor, token: torch.Tensor) -> Counter[str]:
    torch.manual_seed(0)
    model = Transformer(replace(TINY, n_layers=n_layers, max_seq_len=64))
    model.init_weights()
    cache = KVCache(max_len=64)
    with torch.no_grad(), _CountOps() as counter:
        for tokens in (prompt, chunk, token):  # the prompt, a chunk at an offset, one new token
            model(tokens, kv_cache=cache)
            cache.advance(tokens.shape[1])
    return counter.ops


def test_generation_with_a_kv_cache_copies_no_keys_or_values():
    assert TINY.n_heads != TINY.n_kv_heads  # grouped-query attention is what is checked
    g = torch.Generator().manual_seed(0)
    prompt, chunk, token = (torch.randint(0, TINY.vocab_size, (2, n), generator=g) for n in (8, 4, 1))
    per_layer = _per_layer(_decode_ops(1, prompt, chunk, token), _decode_ops(2, prompt, chunk, token))
    copies = {op: per_layer[op] for op in KV_COPY_OPS if op in per_layer}
    # Per layer: the cache writes (k and v, 3 forwards) and nothing else (torch's CPU flash kernel
    # returns its output in the [B, S, H, Dh] layout, so .contiguous() before wo copies nothing).
    assert copies == {"aten.copy_": 6}, per_layer
