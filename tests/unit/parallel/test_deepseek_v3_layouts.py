"""deepseek_v3's layouts on a tiny model (gloo ranks): each layout's losses and grad norms against
the same data-parallel layout without it, 10 steps in fp32 (1e-5; EP with per-op selective AC: 3)
and EP and TP in bf16 parameters (within bf16's rounding); TP for both query shapes (low-rank
wq_a/q_norm/wq_b and a plain wq); checkpoints that resume exactly and move between EP degrees. The
layouts of one world size share one spawned process group; each builds its Trainer in turn."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import GLOBAL_BATCH, VOCAB, batches, config
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


def _trainer(dump: str, dp: int, *flags: str) -> Trainer:
    batch = ("--training.local_batch_size", str(GLOBAL_BATCH // dp), "--training.global_batch_size", str(GLOBAL_BATCH))
    return Trainer(config(dump, *DS, *batch, "--metrics.log_freq", "5", "--optimizer.lr", "1e-3", *flags))


def _curve(trainer: Trainer, steps: int | None = None) -> list[tuple[float, float]]:
    dp = trainer.parallel_dims.dp_degree
    per, r = GLOBAL_BATCH // dp, trainer.dp_rank
    out = []
    for inputs, labels in batches()[:steps]:
        x, y = inputs[r * per : (r + 1) * per], labels[r * per : (r + 1) * per]
        n = trainer.grad_accum_steps
        loss, norm = trainer.train_step(list(zip(x.chunk(n), y.chunk(n))))
        out.append((loss.item(), norm.item()))
    return out


def _layouts(dump: str, layouts: dict[str, tuple[int, tuple[str, ...]]]) -> dict:
    return {
        name: _curve(_trainer(dump, dp, *flags), SAC_STEPS if "_sac" in name else None)
        for name, (dp, flags) in layouts.items()
    }


def _train_loop(dump: str, world: int, steps: int, *flags: str) -> dict[int, float]:
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0")
    return _trainer(dump, world, "--training.steps", str(steps), "--metrics.log_freq", "1", *ckpt, *flags).train()


def on_two_ranks(rank: int, world: int, dump: str) -> dict:
    with dstest_flavor():
        out = _layouts(
            f"{dump}/parity",
            {
                "fsdp2": (2, (SHARD, "2")),
                "ep2": (2, (SHARD, "2", *EP2)),
                "ep2_ac": (2, (SHARD, "2", *EP2, "--activation_checkpoint.mode", "full")),
                "ep2_sac": (2, (SHARD, "2", *EP2, *SAC)),
                "pp2": (1, ("--parallelism.pipeline_parallel_degree", "2", SHARD, "1")),
                "fsdp2_bf16": (2, (SHARD, "2", *BF16)),
                "ep2_bf16": (2, (SHARD, "2", *EP2, *BF16)),
                "tp2": (1, TP2),
                "tp2_bf16": (1, (*TP2, *BF16)),
                "fsdp2_wq": (2, (SHARD, "2", *WQ)),
                "tp2_wq": (1, (*TP2, *WQ)),
                "tp2_wq_bf16": (1, (*TP2, *WQ, *BF16)),
                "tp2_muon": (1, (*TP2, *MUON)),
                "tp2_ac": (1, (*TP2, "--activation_checkpoint.mode", "full")),
            },
        )
        # Save at EP 2 (steps 5 and 10); resume step 5 at EP 1, which trains steps 6-10 again.
        out["uninterrupted"] = _train_loop(f"{dump}/ep2", world, 10, SHARD, "2", *EP2)
        if rank == 0:
            for name in ("ep1", "ep4"):
                shutil.copytree(f"{dump}/ep2", f"{dump}/{name}", ignore=shutil.ignore_patterns("step-10"))
        torch.distributed.barrier()
        out["resumed"] = _train_loop(f"{dump}/ep1", world, 10, SHARD, "2")
        return out


def on_four_ranks(rank: int, world: int, dump: str) -> dict:
    with dstest_flavor():
        out = _layouts(
            f"{dump}/parity4",
            {
                "fsdp4": (4, (SHARD, "4")),
                "hsdp2x2": (4, (SHARD, "2", "--parallelism.data_parallel_replicate_degree", "2")),
                "ep2_fsdp2": (4, (SHARD, "4", *EP2)),
                # TP 2 x EP 2 x ETP 2 (every TP rank holds a slice of its EP rank's experts) x FSDP 2.
                "fsdp2_tp2_ep2": (2, (SHARD, "2", *TP2, *EP2, "--parallelism.expert_tensor_parallel_degree", "2")),
            },
        )
        # The EP 2 run's step-5 checkpoint loads at EP 4 (4 data-parallel ranks: another local batch).
        ep4 = (SHARD, "4", "--parallelism.expert_parallel_degree", "4", "--checkpoint.config_mismatch", "use_new")
        out["ep4"] = _train_loop(f"{dump}/ep4", world, 10, *ep4)
        return out


def _close(a: list, b: list, name: str, tol: float = TOL, relative: bool = False) -> float:
    def diff(x: float, y: float) -> float:
        return abs(x - y) / (abs(y) if relative else 1.0)

    worst = max(diff(x[0], y[0]) for x, y in zip(a, b, strict=True))
    assert worst < tol, (name, a, b)
    assert all(diff(x[1], y[1]) < 10 * tol for x, y in zip(a, b)), (name, a, b)
    return worst


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[list[dict], Path]:
    dump = tmp_path_factory.mktemp("ds")
    return run_distributed(on_two_ranks, 2, str(dump), timeout=900), dump


@pytest.mark.slow
def test_ep_and_ac_reproduce_fsdp_and_pp_the_one_rank_curve(two, tmp_path) -> None:
    results, _ = two
    with dstest_flavor():
        reference = _curve(_trainer(str(tmp_path), GLOBAL_BATCH))
    for per_rank in results:
        _close(per_rank["ep2"], per_rank["fsdp2"], "ep2")
        _close(per_rank["ep2_ac"], per_rank["fsdp2"], "ep2 + full AC")
        _close(per_rank["ep2_sac"], per_rank["ep2"][:SAC_STEPS], "ep2 + per-op SAC")
        _close(per_rank["pp2"], reference, "pp2", PP_RTOL, relative=True)
        _close(per_rank["ep2_bf16"], per_rank["fsdp2_bf16"], "ep2 bf16", BF16_TOL, relative=True)
        _close(per_rank["fsdp2_bf16"], per_rank["fsdp2"], "bf16 vs fp32", BF16_TOL, relative=True)


@pytest.mark.slow
def test_tensor_parallel_latent_attention_reproduces_fsdp_for_both_query_shapes(two, tmp_path) -> None:
    with dstest_flavor():
        muon = _curve(_trainer(str(tmp_path), GLOBAL_BATCH, *MUON))
    for per_rank in two[0]:
        # Muon orthogonalises each TP-sharded matrix whole (the replicated latent ones as they are).
        _close(per_rank["tp2_muon"], muon, "tp2 muon")
        _close(per_rank["tp2"], per_rank["fsdp2"], "tp2 (wq_a, q_norm, wq_b)")
        _close(per_rank["tp2_wq"], per_rank["fsdp2_wq"], "tp2 (wq)")
        _close(per_rank["tp2_ac"], per_rank["fsdp2"], "tp2 + full AC (the recompute sums the same gradients)")
        # Without FSDP, bf16 is autocast's: compared with the fp32 curve, as fsdp2_bf16 is.
        _close(per_rank["tp2_bf16"], per_rank["fsdp2"], "tp2 bf16 vs fp32", BF16_TOL, relative=True)
        _close(per_rank["tp2_wq_bf16"], per_rank["fsdp2_wq"], "tp2 (wq) bf16 vs fp32", BF16_TOL, relative=True)


@pytest.mark.slow
def test_saved_at_ep2_resumed_at_ep1_continues_the_curve(two) -> None:
    for per_rank in two[0]:
        full, resumed = per_rank["uninterrupted"], per_rank["resumed"]
        assert sorted(resumed) == list(range(6, 11)), resumed
        assert max(abs(resumed[s] - full[s]) for s in resumed) < TOL, (full, resumed)


@pytest.mark.slow
def test_four_rank_layouts_and_reshard_to_ep4(two) -> None:
    results_two, dump = two
    results = run_distributed(on_four_ranks, 4, str(dump), timeout=900)
    for per_rank in results:
        _close(per_rank["ep2_fsdp2"], per_rank["fsdp4"], "ep2 x fsdp2")
        _close(per_rank["hsdp2x2"], per_rank["fsdp4"], "hsdp 2x2")
        _close(per_rank["fsdp2_tp2_ep2"], per_rank["fsdp4"], "fsdp2 x tp2 x ep2 (etp 2)")
        # Resumed at step 6 with EP 4 and trained on (its data shards differ from the 2-rank run's).
        assert sorted(per_rank["ep4"]) == list(range(6, 11))
        assert all(torch.isfinite(torch.tensor(v)) for v in per_rank["ep4"].values())
        assert per_rank["ep4"][6] < results_two[0]["uninterrupted"][1]
