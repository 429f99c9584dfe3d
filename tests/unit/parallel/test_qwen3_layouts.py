"""qwen3's layouts on gloo ranks: every layout's (loss, grad norm) per step against the same data-parallel
layout without it, within 1e-5 for 10 steps in fp32 (1e-4 against the one-process run, as the dense
layouts' test) and within bf16's tolerance with bf16 parameters. The dense tiny model has its own
head width (24, not dim / heads = 16) so the q/k norms under TP act on local heads of another width;
the MoE one keeps block 0 dense (mlp_only_layers) and applies the router's scores to the experts'
outputs, as Qwen3 does (under TP their gradient is summed over the TP ranks). One 2-rank and one
4-rank spawn run every layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import GLOBAL_BATCH, VOCAB, close, config, run
from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.models.moe import MoEArgs
from titan.models.qwen3 import Qwen3ModelArgs
from titan.training.trainer import Trainer

pytestmark = pytest.mark.slow

TOL = 1e-5
PP_RTOL = 1e-5  # pipeline micro-batches sum in another order: a few ulps of the loss, so relative
BF16_TOL = 2e-2  # bf16 parameters: 8 mantissa bits, about 4e-3 per rounding; two layouts round apart
SHAPE = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=24, vocab_size=VOCAB, hidden_dim=96)
FLAVORS = {
    "q3test": Qwen3ModelArgs(**SHAPE),
    "q3moetest": Qwen3ModelArgs(
        **SHAPE,
        moe_enabled=True,
        mlp_only_layers=[0],
        moe_args=MoEArgs(num_experts=4, top_k=2, num_shared_experts=0, score_func="softmax", route_norm=True,
                         score_before_experts=False, hidden_dim=48, load_balance_coeff=1e-2),
    ),
}  # fmt: skip
SHARD = "--parallelism.data_parallel_shard_degree"
BF16 = ("--training.mixed_precision_param", "bfloat16")


@contextlib.contextmanager
def qwen3_flavors() -> Iterator[None]:
    saved = get_model_spec("qwen3")
    try:
        for name, args in FLAVORS.items():
            register_flavor("qwen3", name, args, replace=True)
        yield
    finally:
        register_model_spec(saved, replace=True)


def _trainer(dump: str, flavor: str, dp: int, *flags: str) -> Trainer:
    batch = ("--training.local_batch_size", str(GLOBAL_BATCH // dp), "--training.global_batch_size", str(GLOBAL_BATCH))
    model = ("--model.name", "qwen3", "--model.flavor", flavor)
    return Trainer(config(dump, *model, *batch, "--metrics.log_freq", "5", "--optimizer.lr", "1e-4", *flags))


def _layouts(dump: str, layouts: dict[str, tuple[str, int, tuple[str, ...]]]) -> dict:
    with qwen3_flavors():
        return {name: run(_trainer(dump, flavor, dp, *flags)) for name, (flavor, dp, flags) in layouts.items()}


def on_two_ranks(rank: int, world: int, dump: str) -> dict:
    tp2 = ("--parallelism.tensor_parallel_degree", "2", SHARD, "1")
    ep2 = (SHARD, "2", "--parallelism.expert_parallel_degree", "2")
    return _layouts(
        dump,
        {
            "fsdp2": ("q3test", 2, (SHARD, "2")),
            "fsdp2_ac_chunked": ("q3test", 2, (SHARD, "2", "--activation_checkpoint.mode", "full",
                                               "--training.loss_chunk_tokens", "16")),
            "tp2": ("q3test", 1, tp2),
            "pp2": ("q3test", 1, ("--parallelism.pipeline_parallel_degree", "2", SHARD, "1")),
            "moe_fsdp2": ("q3moetest", 2, (SHARD, "2")),
            "moe_ep2": ("q3moetest", 2, ep2),
            "moe_fsdp2_bf16": ("q3moetest", 2, (SHARD, "2", *BF16)),
            "moe_ep2_bf16": ("q3moetest", 2, (*ep2, *BF16)),
            "tp2_bf16": ("q3test", 1, (*tp2, *BF16)),
            # The router's scores weight the experts' TP-partial outputs: their gradient summed over TP.
            "moe_tp2": ("q3moetest", 1, tp2),
            "moe_tp2_bf16": ("q3moetest", 1, (*tp2, *BF16)),
        },
    )  # fmt: skip


def on_four_ranks(rank: int, world: int, dump: str) -> dict:
    return _layouts(
        dump,
        {
            "fsdp4": ("q3test", 4, (SHARD, "4")),
            "hsdp2x2": ("q3test", 4, (SHARD, "2", "--parallelism.data_parallel_replicate_degree", "2")),
            "fsdp2": ("q3test", 2, (SHARD, "2", "--parallelism.tensor_parallel_degree", "2")),
            "moe_fsdp4": ("q3moetest", 4, (SHARD, "4")),
            "moe_ep4": ("q3moetest", 4, (SHARD, "4", "--parallelism.expert_parallel_degree", "4")),
            "moe_ep2_pp2": ("q3moetest", 2, (SHARD, "2", "--parallelism.expert_parallel_degree", "2",
                                             "--parallelism.pipeline_parallel_degree", "2")),
            "moe_ep2_etp2": ("q3moetest", 2, (SHARD, "2", "--parallelism.tensor_parallel_degree", "2",
                                              "--parallelism.expert_parallel_degree", "2",
                                              "--parallelism.expert_tensor_parallel_degree", "2")),
        },
    )  # fmt: skip


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """The one-process runs: one sequence per forward (the pipeline's micro-batch shapes)."""
    dump = str(tmp_path_factory.mktemp("q3ref"))
    with qwen3_flavors():
        return {f: run(_trainer(dump, f, GLOBAL_BATCH)) for f in ("q3test", "q3moetest")}


def test_two_rank_layouts_match_their_data_parallel_layout(tmp_path: Path, references: dict) -> None:
    results = run_distributed(on_two_ranks, 2, str(tmp_path), timeout=600)
    dense, moe = references["q3test"], references["q3moetest"]
    for r in results:
        close(r["fsdp2"], dense, "fsdp2 vs 1 process", 1e-4)
        close(r["moe_fsdp2"], moe, "moe fsdp2 vs 1 process", 1e-4)
        close(r["fsdp2_ac_chunked"], r["fsdp2"], "full AC + chunked loss")
        close(r["tp2"], dense, "tp2 (q/k norms on local heads)")
        close(r["pp2"], dense, "pp2", PP_RTOL, relative=True)
        close(r["moe_ep2"], r["moe_fsdp2"], "ep2")
        close(r["moe_ep2_bf16"], r["moe_fsdp2_bf16"], "ep2 bf16", BF16_TOL, relative=True)
        close(r["moe_ep2_bf16"], r["moe_ep2"], "ep2 bf16 vs fp32", BF16_TOL, relative=True)
        close(r["tp2_bf16"], dense, "tp2 bf16 vs fp32", BF16_TOL, relative=True)
        close(r["moe_tp2"], moe, "moe tp2 (scores after the experts)")
        close(r["moe_tp2_bf16"], moe, "moe tp2 bf16 vs fp32", BF16_TOL, relative=True)
    results4 = run_distributed(on_four_ranks, 4, str(tmp_path), timeout=600)
    for r4 in results4:
        close(r4["fsdp4"], dense, "fsdp4 vs 1 process", 1e-4)
        close(r4["hsdp2x2"], r4["fsdp4"], "hsdp 2x2")
        close(r4["fsdp2"], results[0]["fsdp2"], "fsdp2 x tp2")
        close(r4["moe_ep4"], r4["moe_fsdp4"], "ep4")
        close(r4["moe_ep2_pp2"], results[0]["moe_fsdp2"], "ep2 x pp2", PP_RTOL, relative=True)
        close(r4["moe_ep2_etp2"], results[0]["moe_tp2"], "ep2 x etp2 x fsdp2 vs tp2")
