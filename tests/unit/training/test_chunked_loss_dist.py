"""The chunked loss against the full logits in the trainer's parallel layouts, on 2 gloo ranks that
share one spawned process group: TP 2 with loss parallel (vocab-sharded output), PP 2 (last stage,
per micro-batch) and FSDP 2 (the output projection as its own FSDP unit). fp32, 20 steps:
losses within 2^-17 relative each step (see FP32_RTOL), gradients within 1e-5 relative after the
first and the last step.
bfloat16 parameters, 3 steps: the same layout with full logits as the reference, within bf16's
rounding (see BF16_RTOL)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import FLAVORS, GLOBAL_BATCH, batches, config
from tests.helpers.tiny import extra_flavors
from titan.training.trainer import Trainer

STEPS = 20
BF16_STEPS = 3  # bf16 matmuls are slow on CPU: the first and last step compare gradients
BF16 = ("--training.mixed_precision_param", "bfloat16")
# Chunking changes how many rows one output matmul computes, not their arithmetic, except where a
# bf16 kernel's blocking follows the row count: then some logits round differently, by at most
# u = 2^-8 relative. Logits are O(1) here and cross-entropy moves by at most 2 max|d logit| per
# token, so the loss (~7.6) moves by <= 2u / 7.6 ~ 2^-10 relative; a gradient is a sum of terms each
# off by about u: 2^-7 relative (two roundings) for the gradients.
BF16_RTOL, BF16_GRAD_RTOL = 2.0**-10, 2.0**-7
# fp32: the chunked loss adds its chunks' sums (here up to 22 of them, after up to 48 tokens each)
# where the full loss reduces all tokens at once, in an order that follows the kernel's threads; each
# addition rounds by at most 2^-24 relative, so the two means may differ by a few tens of those.
# Seen: 2^-20 (tp2, 7 ulps of a loss of 8); 2^-17 leaves room for 128 roundings.
FP32_RTOL = 2.0**-17
CHUNK = ("--training.loss_chunk_tokens", "48")  # 64 or 128 tokens per micro-batch: uneven last chunk
_S1 = ("--parallelism.data_parallel_shard_degree", "1")
LAYOUTS = {
    "tp2": ("--parallelism.tensor_parallel_degree", "2", *_S1),
    "pp2": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B", *_S1),
    "fsdp2": ("--parallelism.data_parallel_shard_degree", "2"),
}


def _grads(trainer: Trainer) -> list[torch.Tensor]:
    return [
        (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for part in trainer.model_parts
        for p in part.parameters()
        if p.grad is not None
    ]


def _run(dump: str, flags: tuple[str, ...], steps: int = STEPS):
    dp = 2 if flags[0].startswith("--parallelism.data_parallel") else 1
    trainer = Trainer(
        config(
            dump,
            "--training.local_batch_size",
            str(GLOBAL_BATCH // dp),
            "--training.global_batch_size",
            str(GLOBAL_BATCH),
            "--training.steps",
            str(steps),
            *flags,
        )
    )
    per, r = GLOBAL_BATCH // dp, trainer.dp_rank
    losses, grads = [], []
    for step, (inputs, labels) in enumerate((batches() * 2)[:steps]):
        loss, _ = trainer.train_step([(inputs[r * per : (r + 1) * per], labels[r * per : (r + 1) * per])])
        losses.append(loss.item())
        if step in (0, steps - 1):
            grads.append(_grads(trainer))
    del trainer
    return losses, grads


def _layouts(rank: int, world: int, dump: str) -> dict:
    with extra_flavors(**FLAVORS):
        out = {name: (_run(dump, flags), _run(dump, (*flags, *CHUNK))) for name, flags in LAYOUTS.items()}
        for name, flags in LAYOUTS.items():
            out[f"{name}_bf16"] = (
                _run(dump, (*flags, *BF16), BF16_STEPS),
                _run(dump, (*flags, *BF16, *CHUNK), BF16_STEPS),
            )
        return out


@pytest.mark.slow
def test_chunked_equals_full_in_parallel_layouts(tmp_path):
    for per_rank in run_distributed(_layouts, 2, str(tmp_path), timeout=900):
        for name, ((full_losses, full_grads), (losses, grads)) in per_rank.items():
            bf16 = name.endswith("_bf16")
            assert len(losses) == (BF16_STEPS if bf16 else STEPS)
            worst = 0.0
            for a, b in zip(full_losses, losses):
                worst = max(worst, abs(a - b) / abs(a))
                assert worst <= (BF16_RTOL if bf16 else FP32_RTOL), (name, full_losses, losses)
            for at_full, at_chunk in zip(full_grads, grads):
                assert len(at_full) == len(at_chunk) > 0, name
                for g, h in zip(at_full, at_chunk):
                    assert ((g - h).norm() / g.norm()).item() <= (BF16_GRAD_RTOL if bf16 else 1e-5), name
            print(f"{name}: chunked vs full logits, worst loss difference {worst:.2e}")
