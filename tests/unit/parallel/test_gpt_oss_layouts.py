"""gpt_oss's layouts on gloo ranks: each layout's losses and grad norms against the same
data-parallel layout without it, 10 steps, fp32 within 1e-5 (EP, EP + full AC, TP + SP, HSDP,
EP x FSDP, EP 4, TP x EP x ETP x FSDP; PP against one process) and bf16 parameters within bf16's
tolerance (EP 2 and TP 2 against FSDP 2); the router's gradient under TP against one process's;
checkpoints resume exactly at the same layout and move between EP degrees (2 -> 1 -> 4). The
layouts of one world size share one spawned process group; each builds its Trainer in turn."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import GLOBAL_BATCH, VOCAB, close, config, run
from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe
from titan.models.moe import MoE
from titan.models.moe.parallelize import moe_tp_plan
from titan.parallel.expert_parallel import ExpertTensorParallel
from titan.training.trainer import Trainer

pytestmark = pytest.mark.slow

TOL = 1e-5
PP_RTOL = 1e-5  # micro-batches sum in another order than one process: relative float32 ulps
# bf16 parameters: both runs round every matmul to 8 bits of mantissa, in different orders
# (all-to-all vs local rows): a few bf16 ulps of a loss near 7.6 (ulp 0.03).
BF16_TOL = 0.1
# 4 layers (2 sliding over 8 of the 32 positions), 4 experts of 32 (EP 1, 2 or 4), top 2, biases
# everywhere, YaRN over an original context of 16, bias balancing on.
GPTEST = GptOssModelArgs(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_seq_len=64,
    sliding_window_size=8,
    rope_factor=4.0,
    original_seq_len=16,
    moe_args=dataclasses.replace(gpt_oss_moe(4), top_k=2, hidden_dim=32, load_balance_coeff=1e-2),
)
SHARD = "--parallelism.data_parallel_shard_degree"
EP2 = ("--parallelism.expert_parallel_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
ETP2 = ("--parallelism.expert_tensor_parallel_degree", "2")
BF16 = ("--training.mixed_precision_param", "bfloat16")
GPT_OSS = ("--model.name", "gpt_oss", "--model.flavor", "gptest")


@contextlib.contextmanager
def gptest_flavor() -> Iterator[None]:
    saved = get_model_spec("gpt_oss")
    try:
        register_flavor("gpt_oss", "gptest", GPTEST, replace=True)
        yield
    finally:
        register_model_spec(saved, replace=True)


def _trainer(dump: str, dp: int, *flags: str) -> Trainer:
    batch = ("--training.local_batch_size", str(GLOBAL_BATCH // dp), "--training.global_batch_size", str(GLOBAL_BATCH))
    return Trainer(config(dump, *GPT_OSS, *batch, "--metrics.log_freq", "5", "--optimizer.lr", "1e-3", *flags))


def _layouts(dump: str, layouts: dict[str, tuple[int, tuple[str, ...]]]) -> dict:
    return {name: run(_trainer(f"{dump}/{name}", dp, *flags)) for name, (dp, flags) in layouts.items()}


def _train_loop(dump: str, world: int, steps: int, *flags: str) -> dict[int, float]:
    """Trainer.train over the config's own data, checkpointing every 5 steps."""
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0")
    return _trainer(dump, world, "--training.steps", str(steps), "--metrics.log_freq", "1", *ckpt, *flags).train()


def router_grads(rank: int, world: int, sum_scores: bool = True) -> dict[str, torch.Tensor]:
    """One gpt-oss MoE layer (scores times the experts' outputs, biases everywhere) on a [2, 8]
    batch: the router's gradient (and the layer's output, input gradient and down bias gradient)
    under TP over ``world`` ranks minus the same on one process, every rank its own sequence slice.
    ``sum_scores=False`` leaves out the sum of the score gradient over TP."""
    torch.manual_seed(0)
    whole = MoE(GPTEST.moe_args, GPTEST.dim)
    whole.init_weights(0.02)
    with torch.no_grad():  # large enough that the clamps act and the biases matter
        for p in whole.parameters():
            p.normal_(0, 0.3)
    x, weight = torch.randn(2, 8, GPTEST.dim), torch.randn(2, 8, GPTEST.dim)
    block = nn.Module()
    block.moe = copy.deepcopy(whole)
    ref_x = x.clone().requires_grad_()
    ref_out = whole(ref_x)
    (ref_out * weight).sum().backward()
    mesh = init_device_mesh("cpu", (world,))
    plan = moe_tp_plan(block)
    if not sum_scores:
        del plan["moe.router"]
    parallelize_module(block, mesh, plan)
    parallelize_module(block.moe.experts, mesh, ExpertTensorParallel())
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    local_x = x[:, rows].clone().requires_grad_()
    out = block.moe(local_x)
    (out * weight[:, rows]).sum().backward()  # the loss is the sum of every rank's
    gate, ref_gate = block.moe.router.gate, whole.router.gate
    assert ref_x.grad is not None and local_x.grad is not None
    return {
        "gate.weight": gate.weight.grad.full_tensor() - ref_gate.weight.grad,
        "gate.bias": gate.bias.grad.full_tensor() - ref_gate.bias.grad,
        "b2": block.moe.experts.b2.grad.full_tensor() - whole.experts.b2.grad,
        "output": out - ref_out[:, rows],
        "input grad": local_x.grad - ref_x.grad[:, rows],
        "scale": ref_gate.weight.grad.abs().max(),
    }


def on_two_ranks(rank: int, world: int, dump: str) -> dict:
    with gptest_flavor():
        out = _layouts(
            f"{dump}/parity",
            {
                "fsdp2": (2, (SHARD, "2")),
                "ep2": (2, (SHARD, "2", *EP2)),
                "ep2_ac": (2, (SHARD, "2", *EP2, "--activation_checkpoint.mode", "full")),
                "tp2": (1, (SHARD, "1", *TP2)),
                "pp2": (1, ("--parallelism.pipeline_parallel_degree", "2", SHARD, "1")),
                "fsdp2_bf16": (2, (SHARD, "2", *BF16)),
                "ep2_bf16": (2, (SHARD, "2", *EP2, *BF16)),
                "tp2_bf16": (1, (SHARD, "1", *TP2, *BF16)),
            },
        )
        out["router"] = router_grads(rank, world)
        out["router_unsummed"] = router_grads(rank, world, sum_scores=False)
        # Saved at EP 2 (steps 5 and 10); step 5 resumed at EP 2 (exact) and at EP 1 (resharded).
        out["uninterrupted"] = _train_loop(f"{dump}/ep2", world, 10, SHARD, "2", *EP2)
        if rank == 0:
            for name in ("same", "ep1"):
                shutil.copytree(f"{dump}/ep2", f"{dump}/{name}", ignore=shutil.ignore_patterns("step-10"))
        torch.distributed.barrier()
        out["resumed_same"] = _train_loop(f"{dump}/same", world, 10, SHARD, "2", *EP2)
        out["resumed_ep1"] = _train_loop(f"{dump}/ep1", world, 10, SHARD, "2")
        return out


def on_four_ranks(rank: int, world: int, dump: str) -> dict:
    with gptest_flavor():
        out = _layouts(
            f"{dump}/parity4",
            {
                "fsdp4": (4, (SHARD, "4")),
                "ep2_fsdp4": (4, (SHARD, "4", *EP2)),
                "ep4": (4, (SHARD, "4", "--parallelism.expert_parallel_degree", "4")),
                "hsdp": (4, (SHARD, "2", "--parallelism.data_parallel_replicate_degree", "2")),
                "tp2_etp2_fsdp2": (2, (SHARD, "2", *TP2, *EP2, *ETP2)),
            },
        )
        # EP 1's step-10 checkpoint (saved by the two-rank group) loads at EP 4 and trains on.
        new = ("--checkpoint.config_mismatch", "use_new")  # 4 ranks: another local batch size
        ep4 = ("--parallelism.expert_parallel_degree", "4")
        out["to_ep4"] = _train_loop(f"{dump}/ep1", world, 11, SHARD, "4", *ep4, *new)
        return out


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[list[dict], Path]:
    dump = tmp_path_factory.mktemp("gpt_oss")
    return run_distributed(on_two_ranks, 2, str(dump), timeout=900), dump


def test_two_rank_layouts_match_fsdp2(two, tmp_path) -> None:
    results, _ = two
    with gptest_flavor():
        reference = run(_trainer(str(tmp_path), GLOBAL_BATCH))  # one process, one sequence per forward
    for per_rank in results:
        close(per_rank["ep2"], per_rank["fsdp2"], "ep2")
        close(per_rank["ep2_ac"], per_rank["fsdp2"], "ep2 + full AC")
        close(per_rank["tp2"], per_rank["fsdp2"], "tp2")
        close(per_rank["tp2_bf16"], per_rank["fsdp2_bf16"], "tp2 bf16", BF16_TOL)
        close(per_rank["pp2"], reference, "pp2", PP_RTOL, relative=True)
        close(per_rank["ep2_bf16"], per_rank["fsdp2_bf16"], "ep2 bf16", BF16_TOL)
        close(per_rank["fsdp2_bf16"], per_rank["fsdp2"], "fsdp2 bf16 vs fp32", BF16_TOL)


def test_router_gradient_under_tp_equals_one_process(two) -> None:
    """The scores multiply TP-partial expert outputs: each rank's score gradient is a partial sum
    until summed over TP. fp32 sums in another order: a few ulps of the largest entry."""
    for per_rank in two[0]:
        tol = 1e-5 * float(per_rank["router"]["scale"])
        for name, diff in per_rank["router"].items():
            assert name == "scale" or diff.abs().max() < tol, (name, diff.abs().max())
        # Without the sum the router's gradient is wrong (the test can fail), the rest is not.
        assert per_rank["router_unsummed"]["gate.weight"].abs().max() > 100 * tol
        assert per_rank["router_unsummed"]["output"].abs().max() < tol


def test_checkpoints_resume_exactly_and_reshard_from_ep2_to_ep1(two) -> None:
    for per_rank in two[0]:
        full = per_rank["uninterrupted"]
        assert sorted(per_rank["resumed_same"]) == list(range(6, 11))
        assert all(per_rank["resumed_same"][s] == full[s] for s in range(6, 11)), (full, per_rank["resumed_same"])
        assert max(abs(per_rank["resumed_ep1"][s] - full[s]) for s in range(6, 11)) < TOL


def test_four_rank_layouts_and_reshard_to_ep4(two) -> None:
    _, dump = two
    for per_rank in run_distributed(on_four_ranks, 4, str(dump), timeout=900):
        for name in ("ep2_fsdp4", "ep4", "hsdp", "tp2_etp2_fsdp2"):
            close(per_rank[name], per_rank["fsdp4"], name)
        assert list(per_rank["to_ep4"]) == [11] and torch.isfinite(torch.tensor(per_rank["to_ep4"][11]))
