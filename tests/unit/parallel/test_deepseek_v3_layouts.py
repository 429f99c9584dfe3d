"""deepseek_v3's layouts on a tiny model (gloo ranks): each layout's losses and grad norms against
the same data-parallel layout without it, 10 steps in fp32 (1e-5; EP with per-op selective AC: 3)
and EP and TP in bf16 parameters (within bf16's rounding); TP for both query shapes (low-rank
wq_a/q_norm/wq_b and a plain wq); checkpoints that resume exactly and move between EP degrees. The
layouts of one world size share one spawned process group; each builds its Trainer in turn."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.deepseek import (
    BF16,
    BF16_TOL,
    EP2,
    MUON,
    PP_RTOL,
    SAC,
    SAC_STEPS,
    SHARD,
    TOL,
    TP2,
    WQ,
    dstest_flavor,
    layouts,
    trainer,
)
from tests.helpers.distributed import run_distributed
from tests.helpers.mtp import MTP2, run_mtp
from tests.helpers.parity import GLOBAL_BATCH, close, run


def _train_loop(dump: str, world: int, steps: int, *flags: str) -> dict[int, float]:
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0")
    return trainer(dump, world, "--training.steps", str(steps), "--metrics.log_freq", "1", *ckpt, *flags).train()


def on_two_ranks(rank: int, world: int, dump: str) -> dict:
    with dstest_flavor():
        out = layouts(
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
        out |= {  # multi-token prediction, two depths: each layout's (loss, grad norm, MTP loss)
            name: run_mtp(trainer(f"{dump}/mtp", dp, *MTP2, *flags))
            for name, (dp, flags) in {
                "mtp_ep2": (2, (SHARD, "2", *EP2)),  # on FSDP 2 (full-logit loss parallel: qwen3_5's TP row)
                # loss parallel by chunks of 48 tokens: chunks end at each depth's 128 rows
                "mtp_tp2_chunked": (1, (*TP2, "--training.loss_chunk_tokens", "48")),
                "mtp_pp2": (1, ("--parallelism.pipeline_parallel_degree", "2", SHARD, "1")),
                "mtp_ep2_bf16": (2, (SHARD, "2", *EP2, *BF16)),
            }.items()
        }
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
        out = layouts(
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


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[list[dict], Path]:
    dump = tmp_path_factory.mktemp("ds")
    return run_distributed(on_two_ranks, 2, str(dump), timeout=900), dump


@pytest.mark.slow
def test_ep_and_ac_reproduce_fsdp_and_pp_the_one_rank_curve(two, tmp_path) -> None:
    results, _ = two
    with dstest_flavor():
        reference = run(trainer(str(tmp_path), GLOBAL_BATCH))
    for per_rank in results:
        close(per_rank["ep2"], per_rank["fsdp2"], "ep2")
        close(per_rank["ep2_ac"], per_rank["fsdp2"], "ep2 + full AC")
        close(per_rank["ep2_sac"], per_rank["ep2"][:SAC_STEPS], "ep2 + per-op SAC")
        close(per_rank["pp2"], reference, "pp2", PP_RTOL, relative=True)
        close(per_rank["ep2_bf16"], per_rank["fsdp2_bf16"], "ep2 bf16", BF16_TOL, relative=True)
        close(per_rank["fsdp2_bf16"], per_rank["fsdp2"], "bf16 vs fp32", BF16_TOL, relative=True)


@pytest.mark.slow
def test_tensor_parallel_latent_attention_reproduces_fsdp_for_both_query_shapes(two, tmp_path) -> None:
    with dstest_flavor():
        muon = run(trainer(str(tmp_path), GLOBAL_BATCH, *MUON))
    for per_rank in two[0]:
        # Muon orthogonalises each TP-sharded matrix whole (the replicated latent ones as they are).
        close(per_rank["tp2_muon"], muon, "tp2 muon")
        close(per_rank["tp2"], per_rank["fsdp2"], "tp2 (wq_a, q_norm, wq_b)")
        close(per_rank["tp2_wq"], per_rank["fsdp2_wq"], "tp2 (wq)")
        close(per_rank["tp2_ac"], per_rank["fsdp2"], "tp2 + full AC (the recompute sums the same gradients)")
        # Without FSDP, bf16 is autocast's: compared with the fp32 curve, as fsdp2_bf16 is.
        close(per_rank["tp2_bf16"], per_rank["fsdp2"], "tp2 bf16 vs fp32", BF16_TOL, relative=True)
        close(per_rank["tp2_wq_bf16"], per_rank["fsdp2_wq"], "tp2 (wq) bf16 vs fp32", BF16_TOL, relative=True)


@pytest.mark.slow
def test_multi_token_prediction_layouts_reproduce_the_one_rank_curve(two, tmp_path) -> None:
    """EP on FSDP, TP (chunked loss parallel) and PP with two MTP depths: the next-token
    loss, the grad norm and the MTP loss of each step as one process computes them (fp32), and EP
    in bf16 parameters within bf16's rounding of that."""
    with dstest_flavor():
        reference = run_mtp(trainer(str(tmp_path), GLOBAL_BATCH, *MTP2))
    for per_rank in two[0]:
        for name in ("mtp_ep2", "mtp_tp2_chunked", "mtp_pp2"):
            close(per_rank[name], reference, name, PP_RTOL, relative=True)
            assert max(abs(a[2] - b[2]) / b[2] for a, b in zip(per_rank[name], reference)) < PP_RTOL, name
        close(per_rank["mtp_ep2_bf16"], reference, "mtp ep2 bf16", BF16_TOL, relative=True)
        assert max(abs(a[2] - b[2]) / b[2] for a, b in zip(per_rank["mtp_ep2_bf16"], reference)) < BF16_TOL


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
        close(per_rank["ep2_fsdp2"], per_rank["fsdp4"], "ep2 x fsdp2")
        close(per_rank["hsdp2x2"], per_rank["fsdp4"], "hsdp 2x2")
        close(per_rank["fsdp2_tp2_ep2"], per_rank["fsdp4"], "fsdp2 x tp2 x ep2 (etp 2)")
        # Resumed at step 6 with EP 4 and trained on (its data shards differ from the 2-rank run's).
        assert sorted(per_rank["ep4"]) == list(range(6, 11))
        assert all(torch.isfinite(torch.tensor(v)) for v in per_rank["ep4"].values())
        assert per_rank["ep4"][6] < results_two[0]["uninterrupted"][1]
