"""The tiny DeepSeek-V3 the layout tests share (tests/unit/parallel/test_deepseek_v3_layouts.py,
tests/cuda/test_moe_cp_gpu.py): its flavors, the layout flags, and a curve per layout on the
ranks of a spawned group."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from tests.helpers.parity import GLOBAL_BATCH, VOCAB, config, run
from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from titan.models.moe import MoEArgs
from titan.training.trainer import Trainer

TOL = 1e-5
# bf16 parameters: the two layouts sum the same bf16 products in another order (all-to-all vs
# local): a few bf16 ulps of the activations, ~1e-2 relative at most on the loss.
BF16_TOL = 3e-2
PP_RTOL = 1e-5
# One dense block then two MoE blocks; low-rank queries, YaRN on (max_seq_len > original_seq_len),
# 4 experts in 2 groups (one kept per token), top 2, a shared expert, sigmoid scores normalised.
DSTEST = DeepSeekV3ModelArgs(
    vocab_size=VOCAB, dim=64, n_layers=3, n_dense_layers=1, n_heads=4, inter_dim=64, moe_inter_dim=32,
    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, original_seq_len=16,
    rope_factor=4.0, mscale=0.7,
    moe_args=MoEArgs(
        num_experts=4, top_k=2, num_shared_experts=1, score_func="sigmoid", route_norm=True, route_scale=2.0,
        score_before_experts=False, num_expert_groups=2, num_limited_groups=1, load_balance_coeff=1e-2,
    ),
)  # fmt: skip
# The same blocks with one full-rank query projection (wq).
DSWQ = dataclasses.replace(DSTEST, q_lora_rank=0)
EP2 = ("--parallelism.expert_parallel_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
WQ = ("--model.flavor", "dswq")
MUON = ("--optimizer.name", "Muon")
SHARD = "--parallelism.data_parallel_shard_degree"
BF16 = ("--training.mixed_precision_param", "bfloat16")
# Per-op selective AC (torchtitan's 16B file): the recompute replays the experts' own FSDP unit.
SAC = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
SAC_STEPS = 3
DS = ("--model.name", "deepseek_v3", "--model.flavor", "dstest")


@contextlib.contextmanager
def dstest_flavor() -> Iterator[None]:
    saved = get_model_spec("deepseek_v3")
    try:
        register_flavor("deepseek_v3", "dstest", DSTEST, replace=True)
        register_flavor("deepseek_v3", "dswq", DSWQ, replace=True)
        yield
    finally:
        register_model_spec(saved, replace=True)


def trainer(dump: str, dp: int, *flags: str) -> Trainer:
    batch = ("--training.local_batch_size", str(GLOBAL_BATCH // dp), "--training.global_batch_size", str(GLOBAL_BATCH))
    return Trainer(config(dump, *DS, *batch, "--metrics.log_freq", "5", "--optimizer.lr", "1e-3", *flags))


def layouts(dump: str, layouts: dict[str, tuple[int, tuple[str, ...]]]) -> dict:
    return {
        name: run(trainer(dump, dp, *flags), SAC_STEPS if "_sac" in name else None)
        for name, (dp, flags) in layouts.items()
    }
