"""QK-clip on FSDP 2, TP 2, EP 2 and PP 2 reproduces the one-process run: per step the loss, the grad norm and
the largest logit of every layer (measured before that step's clip, so it shows every earlier
clip's rescale), 4 steps with a threshold that clips some heads of the tiny models every step.
float32 within 1e-5; bfloat16 parameters within bf16's tolerance of the float32 run. llama3 (grouped
heads, TP splitting them), deepseek_v3 (latent attention: TP splitting wq_b / wkv_b by head rows;
EP with FSDP: dense attention sharded by FSDP), qwen3 (the q/k norm weights, whole on each TP rank)
and gpt-oss (q/k biases split by TP with their rows); the layouts share one spawned group of 2 ranks."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.helpers.deepseek import DS, dstest_flavor
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import FLAVORS, GLOBAL_BATCH, VOCAB, batches, config
from tests.helpers.tiny import extra_flavors
from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe
from titan.models.qwen3.args import Qwen3ModelArgs
from titan.training.qk_clip import PER_LAYER_PREFIX
from titan.training.trainer import Trainer

STEPS = 4
TOL = 1e-5
# bf16 parameters against the fp32 run: bf16 rounds every matmul input (relative 2**-8) and the
# tracked logits themselves; the curves of these tiny models stay within a few 1e-2.
BF16_TOL = 5e-2
HEADS: dict[str, Any] = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=VOCAB)
QKTEST = {
    "qwen3": Qwen3ModelArgs(**HEADS, hidden_dim=64),
    "gpt_oss": GptOssModelArgs(**HEADS, max_seq_len=64, moe_args=dataclasses.replace(gpt_oss_moe(4), top_k=2)),
}
# The largest logits of the tiny models start near 0.11 (llama3), 0.06 (deepseek_v3 and gpt-oss) and
# 3.6 (qwen3, normalised q/k): these thresholds clip some heads (qwen3: whole layers) at every step.
LLAMA = ("--optimizer.qk_clip_threshold", "0.1")
DEEPSEEK = (*DS, "--optimizer.qk_clip_threshold", "0.05")
QWEN3 = ("--model.name", "qwen3", "--model.flavor", "qktest", "--optimizer.qk_clip_threshold", "2")
GPT_OSS = ("--model.name", "gpt_oss", "--model.flavor", "qktest", "--optimizer.qk_clip_threshold", "0.03")
FAMILY = {"llama3": LLAMA, "deepseek_v3": DEEPSEEK, "qwen3": QWEN3, "gpt_oss": GPT_OSS}
SHARD = "--parallelism.data_parallel_shard_degree"
TP2 = ("--parallelism.tensor_parallel_degree", "2", SHARD, "1")
EP2 = ("--parallelism.expert_parallel_degree", "2")
BF16 = ("--training.mixed_precision_param", "bfloat16")
LAYOUTS = {  # name -> (data-parallel degree, flags)
    "llama3_fsdp2": (2, (*LLAMA, SHARD, "2")),
    "llama3_tp2": (1, (*LLAMA, *TP2)),
    "llama3_fsdp2_bf16": (2, (*LLAMA, SHARD, "2", *BF16)),
    # each stage its own layers; torch's shape inference first runs the later one on uninitialised inputs
    "llama3_pp2": (1, (*LLAMA, "--parallelism.pipeline_parallel_degree", "2", SHARD, "1")),
    "deepseek_v3_ep2": (2, (*DEEPSEEK, SHARD, "2", *EP2)),
    "deepseek_v3_tp2": (1, (*DEEPSEEK, *TP2)),
    "deepseek_v3_ep2_bf16": (2, (*DEEPSEEK, SHARD, "2", *EP2, *BF16)),
    "qwen3_tp2": (1, (*QWEN3, *TP2)),
    "gpt_oss_tp2": (1, (*GPT_OSS, *TP2)),
}


@contextlib.contextmanager
def flavors() -> Iterator[None]:
    """The tiny flavors of the four families, registered for the block."""
    saved = [get_model_spec(name) for name in QKTEST]
    with extra_flavors(**FLAVORS), dstest_flavor():
        try:
            for name, args in QKTEST.items():
                register_flavor(name, "qktest", args, replace=True)
            yield
        finally:
            for spec in saved:
                register_model_spec(spec, replace=True)


Curve = dict[str, list[float]]


def _curve(dump: str, dp: int, *flags: str) -> Curve:
    """Per step: the loss, the grad norm and each of this rank's layers' largest logit, by name."""
    batch = ("--training.local_batch_size", str(GLOBAL_BATCH // dp), "--training.global_batch_size", str(GLOBAL_BATCH))
    trainer = Trainer(config(dump, *batch, "--metrics.log_freq", "1", *flags))
    rank = trainer.dp_rank
    out: Curve = {}
    for inputs, labels in batches()[:STEPS]:
        rows = slice(rank * GLOBAL_BATCH // dp, (rank + 1) * GLOBAL_BATCH // dp)
        result = trainer.train_step([(inputs[rows], labels[rows])])
        values = {"loss": result.loss, "grad_norm": result.grad_norm}
        values.update((k, v) for k, v in result.extra.items() if k.startswith(PER_LAYER_PREFIX))
        for key, value in values.items():
            out.setdefault(key, []).append(value.item())
    return out


def _on_ranks(rank: int, world: int, dump: str) -> dict[str, Curve]:
    with flavors():
        return {name: _curve(f"{dump}/{name}", dp, *flags) for name, (dp, flags) in LAYOUTS.items()}


def _family(layout: str) -> str:
    return next(name for name in FAMILY if layout.startswith(name))


@pytest.mark.slow
def test_qk_clip_layouts_match_one_process(tmp_path) -> None:
    results = run_distributed(_on_ranks, 2, str(tmp_path), timeout=900)
    with flavors():
        references = {family: _curve(str(tmp_path / f"ref_{family}"), 1, *flags) for family, flags in FAMILY.items()}
    for name in LAYOUTS:
        ref = references[_family(name)]
        bf16 = name.endswith("bf16")
        for per_rank in results:
            got = per_rank[name]
            layers = [k for k in got if k.startswith(PER_LAYER_PREFIX)]
            assert layers and set(layers) <= set(ref), (name, layers)  # a pipeline stage: its own layers
            # fp32: the loss within 1e-5, the grad norm (~0.7) within 10x that, the logits (~0.1)
            # within 1e-5 of their size; bf16: all within bf16's tolerance of their size.
            rtol, atol = (BF16_TOL, 0.0) if bf16 else (0.0, TOL)
            for key, scale in (("loss", 1), ("grad_norm", 10)):
                torch.testing.assert_close(got[key], ref[key], rtol=rtol, atol=scale * atol, msg=f"{name} {key}")
            rtol = BF16_TOL if bf16 else TOL
            for key in layers:
                torch.testing.assert_close(got[key], ref[key], rtol=rtol, atol=0.0, msg=f"{name} {key}")
