"""Expert parallelism on a tiny llama4 (gloo ranks): each EP layout's losses and grad norms against
the same layout without EP, PP against the one-process run, in float32 and in bfloat16 parameters
(the default); EP with per-op selective activation checkpointing against EP without it; the host
reads of a quiet EP step; checkpoints that move between EP degrees; and the routing counts of an
MoE layer whose experts have their own bf16 FSDP policy. The layouts of one world size share one
spawned process group; each builds its Trainer in turn."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.moe import EPTEST, LLAMA4, SAE, eptest_flavor
from tests.helpers.parity import GLOBAL_BATCH, SEQ, batches, config
from titan.models.moe import MoE, MoEArgs, moe_layers
from titan.training.trainer import Trainer

TOL = 1e-5
# Pipeline micro-batches sum the loss and gradients in another order than one process does: a few
# float32 ulps of the loss (1.3e-5 at a loss of about 7), not growing over the steps; so relative.
PP_RTOL = 1e-5
# bfloat16 parameters: the layouts round at different points (EP regroups the experts' rows, FSDP's
# bf16 policy vs one process's autocast, the pipeline's micro-batches). One rounding moves a value
# by at most u = 2^-8 relative; the logits here are O(1) (init std 0.02), and cross-entropy moves by
# at most 2 max|d logit| per token (its gradient in the logits has L1 norm <= 2), so one rounding
# of every logit, all the same way, moves the loss (~7.6) by <= 2u / 7.6 ~ 2^-10 relative. 5 steps
# at lr 1e-4 add little drift. Measured: 0 (EP 2) and 5e-6 (PP 2) relative. Grad norms: 10x.
BF16_RTOL = 2.0**-10
# bf16 autocast (TP without FSDP) against one float32 process: by the argument above, each of the
# about 8 matmuls on a logit's path rounds once, <= 2 * 8u / 7.6 ~ 2^-7 relative. Measured: 3e-5.
BF16_FP32_RTOL = 2.0**-7
BF16 = ("--training.mixed_precision_param", "bfloat16")
BF16_STEPS = 5  # bf16 matmuls are slow on CPU: half the float32 layouts' steps
# Per-op selective AC under EP: the recompute replays the experts' own FSDP unit inside each block.
SAC = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
SAC_STEPS = 3
TITAN = Path(__file__).resolve().parents[3] / "titan"
MOE_LAYERS = 2
EP2 = ("--parallelism.expert_parallel_degree", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
SHARD = "--parallelism.data_parallel_shard_degree"
USE_NEW = ("--checkpoint.config_mismatch", "use_new")  # 4 ranks: another local batch size


def _trainer(dump: str, dp: int, *flags: str) -> Trainer:
    batch = ("--training.local_batch_size", str(GLOBAL_BATCH // dp), "--training.global_batch_size", str(GLOBAL_BATCH))
    return Trainer(config(dump, *LLAMA4, *batch, "--metrics.log_freq", "5", "--optimizer.lr", "1e-4", *flags))


def _count_host_reads(monkeypatch_like: list, trainer: Trainer, step: int, counts: dict[int, int]) -> None:
    """Wrap the Tensor methods that read a device value on the host; count those called from titan."""
    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, _original=original, **k):
            path = Path(sys._getframe(1).f_code.co_filename)
            if TITAN in path.parents:
                counts[step] = counts.get(step, 0) + 1
            return _original(self, *a, **k)

        monkeypatch_like.append((name, original))
        setattr(torch.Tensor, name, wrapper)


def _curve(trainer: Trainer, reads: dict[int, int] | None = None, steps: int = 10) -> list[tuple[float, float]]:
    """(loss, grad norm) per step over the first ``steps`` fixed batches, this rank's rows of each."""
    dp = trainer.parallel_dims.dp_degree
    per, r = GLOBAL_BATCH // dp, trainer.dp_rank
    out = []
    for step, (inputs, labels) in enumerate(batches()[:steps], start=1):
        x, y = inputs[r * per : (r + 1) * per], labels[r * per : (r + 1) * per]
        patched: list = []
        if reads is not None and step == 3:  # not a log step (log_freq 5)
            _count_host_reads(patched, trainer, step, reads)
        try:
            n = trainer.grad_accum_steps
            loss, norm = trainer.train_step(list(zip(x.chunk(n), y.chunk(n))))
        finally:
            for name, original in patched:
                setattr(torch.Tensor, name, original)
        out.append((loss.item(), norm.item()))
    return out


def _layouts(dump: str, layouts: dict[str, tuple[int, tuple[str, ...]]], reads: dict | None = None) -> dict:
    results = {}
    for name, (dp, flags) in layouts.items():
        steps = SAC_STEPS if "_sac" in name else BF16_STEPS if name.endswith("_bf16") else 10
        results[name] = _curve(_trainer(dump, dp, *flags), reads if name == "ep2" else None, steps)
    return results


def _train_loop(dump: str, world: int, steps: int, *flags: str) -> dict[int, float]:
    """Trainer.train over the config's own data, checkpointing every 5 steps."""
    ckpt = (
        "--checkpoint.enable",
        "--checkpoint.interval",
        "5",
        "--checkpoint.keep_latest_k",
        "0",
        "--metrics.log_freq",
        "1",
    )
    t = _trainer(dump, world, "--training.steps", str(steps), *ckpt, *flags)
    return t.train()


PP2 = ("--parallelism.pipeline_parallel_degree", "2", SHARD, "1")
COUNT_STEPS = 2


def _routing(trainer: Trainer, evaluate_after: int = 0) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, each of this rank's MoE layers' (routed token counts, expert bias) after the bias
    update (log_freq 1: the counts since the last log are the step's); with ``evaluate_after``, a
    validation forward of the next batch after that step, as titan's Validator runs it."""
    per_step: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    layers = moe_layers(trainer.model_parts)

    def read() -> None:
        step = {}
        for name, m in layers:
            assert m.expert_bias is not None  # the flavor balances
            step[name] = (m.tokens_since_log.clone(), m.expert_bias.clone())
        per_step.append(step)

    trainer.optimizers.register_step_post_hook(read)  # after the balancing hook, before the log zeroes the counts
    for step, (inputs, labels) in enumerate(batches()[:COUNT_STEPS], start=1):
        n = trainer.grad_accum_steps
        trainer.train_step(list(zip(inputs.chunk(n), labels.chunk(n))))
        if step == evaluate_after:
            x, y = batches()[step]
            for m in trainer.model_parts:
                m.eval()
            with torch.no_grad():
                trainer.forward.eval_loss_sum(x, y)
            for m in trainer.model_parts:
                m.train()
    return per_step


def _bf16_routing_counts(rank: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """An MoE layer (4 experts, EP 2) whose experts have their own FSDP with a bf16 policy, as
    llama4's plan builds it, over 1030 tokens per rank routed round robin: 258, 258, 257, 257 per
    expert. bf16 holds 257 as 256: counts cast with the experts' floating-point inputs would no
    longer add up to the tokens. (EP output, the same layer computed whole on this rank, the
    dtypes of the counts the experts were called with.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import parallelize_module

    from titan.parallel.expert_parallel import ExpertParallel, apply_experts_fsdp

    torch.manual_seed(0)
    args = MoEArgs(num_experts=4, top_k=1, num_shared_experts=0, load_balance_coeff=None, force_load_balance=True)
    whole = MoE(args, dim=16, hidden_dim=32)
    whole.init_weights(0.02)
    whole.to(torch.bfloat16)
    sharded = MoE(args, dim=16, hidden_dim=32)
    sharded.load_state_dict(whole.state_dict())
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("efsdp", "ep"))
    seen: list = []
    # Runs after FSDP's input cast (FSDP prepends its hook) and before EP's dispatch (added after).
    sharded.experts.register_forward_pre_hook(lambda _, a: seen.append(a[1].dtype))
    parallelize_module(sharded.experts, mesh["ep"], ExpertParallel())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    apply_experts_fsdp(sharded.experts, mesh["efsdp"], args.num_experts, 2, mp_policy=policy)
    sharded.router.to(torch.bfloat16)
    x = torch.randn(1, 1030, 16, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    with torch.no_grad():
        return sharded(x), whole(x), seen


def _hidden_sharded_experts(rank: int) -> dict:
    """Without EP, more FSDP ranks (2) than experts (1): the experts' own FSDP unit shards their
    hidden dim (dim 1), and the layer computes what the whole one does, forward and backward."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan.parallel.expert_parallel import apply_experts_fsdp

    torch.manual_seed(0)
    args = MoEArgs(num_experts=1, top_k=1, num_shared_experts=0, load_balance_coeff=None)
    whole = MoE(args, dim=16, hidden_dim=32)
    whole.init_weights(0.02)
    sharded = MoE(args, dim=16, hidden_dim=32)
    sharded.load_state_dict(whole.state_dict())
    apply_experts_fsdp(sharded.experts, init_device_mesh("cpu", (2,)), args.num_experts, 1)
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(rank))
    out, ref = sharded(x), whole(x)
    out.sum().backward()
    ref.sum().backward()
    w1 = sharded.experts.w1
    grad = whole.experts.w1.grad
    torch.distributed.all_reduce(grad)  # FSDP averages the ranks' gradients
    return {
        "placements": [str(p) for p in w1.placements],
        "local": tuple(w1.to_local().shape),
        "out": (out, ref),
        "grad": (w1.grad.full_tensor(), grad / 2),
    }


def on_two_ranks(rank: int, world: int, dump: str) -> dict:
    with eptest_flavor():
        reads: dict[int, int] = {}
        out = _layouts(
            f"{dump}/parity",
            {
                "fsdp2": (2, (SHARD, "2")),
                "ep2": (2, (SHARD, "2", *EP2)),
                "pp2": (1, PP2),
                "fsdp2_bf16": (2, (SHARD, "2", *BF16)),
                "ep2_bf16": (2, (SHARD, "2", *EP2, *BF16)),
                "ep2_sac": (2, (SHARD, "2", *EP2, *SAC)),
                "ep2_sac_bf16": (2, (SHARD, "2", *EP2, *SAC, *BF16)),
                "pp2_bf16": (1, (*PP2, *BF16)),
                # The router's scores on the experts' TP-partial outputs: their gradient summed over TP.
                "tp2_sae": (1, (*TP2, SHARD, "1", *SAE)),
                "tp2_sae_bf16": (1, (*TP2, SHARD, "1", *SAE, *BF16)),
            },
            reads,
        )
        # Balancing at step 1, a validation (the schedule switches to eval and back), step 2.
        pp = _trainer(f"{dump}/pp_counts", 1, *PP2, "--metrics.log_freq", "1")
        out["pp2_routing"] = _routing(pp, evaluate_after=1)
        out["bf16_counts"] = _bf16_routing_counts(rank)
        out["hidden_sharded"] = _hidden_sharded_experts(rank)
        out["reads"] = reads
        # Save at EP 2 (steps 5 and 10); resume step 5 at EP 1, which saves step 10 again at EP 1.
        out["uninterrupted"] = _train_loop(f"{dump}/ep2", world, 10, SHARD, "2", *EP2)
        if rank == 0:
            shutil.copytree(f"{dump}/ep2", f"{dump}/ep1", ignore=shutil.ignore_patterns("step-10"))
        torch.distributed.barrier()
        out["resumed"] = _train_loop(f"{dump}/ep1", world, 10, SHARD, "2")
        return out


def on_four_ranks(rank: int, world: int, dump: str) -> dict:
    with eptest_flavor():
        tp2 = (*TP2, SHARD, "2")
        out = _layouts(
            f"{dump}/parity4",
            {
                "fsdp4": (4, (SHARD, "4")),
                "ep2_fsdp2": (4, (SHARD, "4", *EP2)),
                "ep2_fsdp2_sac": (4, (SHARD, "4", *EP2, *SAC)),  # the experts FSDP-sharded over 2 ranks
                "tp2": (2, tp2),
                "ep2_etp2": (2, (*tp2, *EP2, "--parallelism.expert_tensor_parallel_degree", "2")),
                "tp2_bf16": (2, (*tp2, *BF16)),
                "ep2_etp2_bf16": (2, (*tp2, *EP2, "--parallelism.expert_tensor_parallel_degree", "2", *BF16)),
                "ep2_etp2_sae": (2, (*tp2, *EP2, "--parallelism.expert_tensor_parallel_degree", "2", *SAE)),
            },
        )
        # EP 1's step-10 checkpoint (saved by the two-rank group) loads at EP 4 and trains on.
        out["ep4"] = _train_loop(
            f"{dump}/ep1", world, 11, SHARD, "4", "--parallelism.expert_parallel_degree", "4", *USE_NEW
        )
        return out


def _close(a: list, b: list, name: str, tol: float = TOL, relative: bool = False) -> float:
    """Per step (loss, grad norm) of ``a`` against ``b``: losses within ``tol`` (of ``b``'s loss if
    ``relative``), grad norms within 10x that."""

    def diff(x: float, y: float) -> float:
        return abs(x - y) / (abs(y) if relative else 1.0)

    diffs = [diff(x[0], y[0]) for x, y in zip(a, b, strict=True)]
    worst = max(diffs)
    assert worst < tol, (name, diffs, a, b)
    assert all(diff(x[1], y[1]) < 10 * tol for x, y in zip(a, b)), (name, a, b)
    return worst


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[list[dict], Path]:
    dump = tmp_path_factory.mktemp("ep")
    return run_distributed(on_two_ranks, 2, str(dump), timeout=600), dump


def test_ep2_reproduces_the_fsdp2_curve_and_reads_the_host_once_per_moe_layer(two) -> None:
    results, _ = two
    for per_rank in results:
        _close(per_rank["ep2"], per_rank["fsdp2"], "ep2")
        # The quiet step's only host reads: the all-to-all split sizes, one per MoE layer.
        assert per_rank["reads"] == {3: MOE_LAYERS}, per_rank["reads"]


def test_ep2_in_bf16_reproduces_the_fsdp2_bf16_curve(two) -> None:
    for per_rank in two[0]:
        worst = _close(per_rank["ep2_bf16"], per_rank["fsdp2_bf16"], "ep2 bf16", BF16_RTOL, relative=True)
        print("ep2 bf16 vs fsdp2 bf16, worst relative loss difference:", worst)


def test_ep2_with_per_op_selective_ac_reproduces_the_ep2_curve(two) -> None:
    for per_rank in two[0]:
        _close(per_rank["ep2_sac"], per_rank["ep2"][:SAC_STEPS], "ep2 + per-op SAC")
        bf16 = per_rank["ep2_bf16"][:SAC_STEPS]
        worst = _close(per_rank["ep2_sac_bf16"], bf16, "ep2 + per-op SAC, bf16", BF16_RTOL, relative=True)
        print("ep2 + per-op SAC bf16 vs ep2 bf16, worst relative loss difference:", worst)


def test_ep_routing_counts_stay_integers_under_a_bf16_experts_policy(two) -> None:
    for out, whole, dtypes in (per_rank["bf16_counts"] for per_rank in two[0]):
        # The experts' forward (its EP dispatch included) was given integer counts ...
        assert dtypes == [torch.int64], dtypes
        # ... and every token reached its expert: the whole layer's output, to bf16's rounding.
        torch.testing.assert_close(out, whole)


def test_more_fsdp_ranks_than_experts_shard_the_hidden_dim(two) -> None:
    for got in (per_rank["hidden_sharded"] for per_rank in two[0]):
        assert got["placements"] == ["S(1)"] and got["local"] == (1, 16, 16), got
        torch.testing.assert_close(*got["out"])
        torch.testing.assert_close(*got["grad"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pp2_reproduces_the_one_rank_curve(two, tmp_path, dtype) -> None:
    bf16 = dtype == "bfloat16"
    with eptest_flavor():
        # One sequence per forward, as the pipeline's micro-batches: the same matmul shapes.
        reference = _curve(
            _trainer(str(tmp_path), GLOBAL_BATCH, *(BF16 if bf16 else ())), steps=BF16_STEPS if bf16 else 10
        )
    for per_rank in two[0]:
        name = "pp2_bf16" if bf16 else "pp2"
        worst = _close(per_rank[name], reference, name, BF16_RTOL if bf16 else PP_RTOL, relative=True)
        print(f"{name} vs one process, worst relative loss difference:", worst)


def test_pp2_routing_counts_and_biases_are_the_one_rank_run_s(two, tmp_path) -> None:
    """Each stage's MoE layer counts the step's tokens only, as one process does (torch's pipeline runs
    every stage once more before the real micro-batches of its first step and after every switch from
    eval: the first stage on micro-batch 0 again, the others on uninitialised inputs), and validation
    counts nothing: per step the counts and the biases they move are exactly the one-process run's."""
    with eptest_flavor():
        # One sequence per forward, as the pipeline's micro-batches: the same routing decisions.
        reference = _routing(_trainer(str(tmp_path), GLOBAL_BATCH, "--metrics.log_freq", "1"))
    tokens = GLOBAL_BATCH * SEQ * EPTEST.moe_args.top_k
    for rank, per_rank in enumerate(two[0]):
        got = per_rank["pp2_routing"]
        assert [list(step) for step in got] == [[f"layers.{2 * rank + 1}.moe"]] * COUNT_STEPS  # a stage's own layer
        for step, (pp, one) in enumerate(zip(got, reference, strict=True), start=1):
            for name, (counts, bias) in pp.items():
                assert counts.sum() == tokens, (step, name, counts)
                assert torch.equal(counts, one[name][0]), (step, name, counts, one[name][0])
                assert torch.equal(bias, one[name][1]), (step, name, bias, one[name][1])


def test_tp2_with_scores_after_the_experts_reproduces_the_one_rank_curve(two, tmp_path) -> None:
    with eptest_flavor():
        reference = _curve(_trainer(str(tmp_path), GLOBAL_BATCH, *SAE))
    for per_rank in two[0]:
        _close(per_rank["tp2_sae"], reference, "tp2, scores after the experts")
        worst = _close(per_rank["tp2_sae_bf16"], reference[:BF16_STEPS], "tp2 bf16 vs fp32", BF16_FP32_RTOL, True)
        print("tp2 bf16 vs one fp32 process (scores after the experts), worst relative loss difference:", worst)


def test_saved_at_ep2_resumed_at_ep1_continues_the_curve(two) -> None:
    results, _ = two
    for per_rank in results:
        full, resumed = per_rank["uninterrupted"], per_rank["resumed"]
        assert sorted(resumed) == list(range(6, 11)), resumed
        worst = max(abs(resumed[s] - full[s]) for s in resumed)
        assert worst < TOL, (full, resumed)


def test_four_rank_layouts_and_reshard_to_ep4(two) -> None:
    _, dump = two
    results = run_distributed(on_four_ranks, 4, str(dump), timeout=600)
    for per_rank in results:
        _close(per_rank["ep2_fsdp2"], per_rank["fsdp4"], "ep2 x fsdp2")
        _close(per_rank["ep2_fsdp2_sac"], per_rank["ep2_fsdp2"][:SAC_STEPS], "ep2 x fsdp2 + per-op SAC")
        _close(per_rank["ep2_etp2"], per_rank["tp2"], "ep2 x tp2 (etp 2)")
        _close(per_rank["ep2_etp2_bf16"], per_rank["tp2_bf16"], "ep2 x tp2 (etp 2), bf16", BF16_RTOL, relative=True)
        # Scores after the experts: against TP 2 alone on two ranks (the same global batch).
        _close(per_rank["ep2_etp2_sae"], two[0][0]["tp2_sae"], "ep2 x tp2 (etp 2), scores after the experts")
        # Loaded EP 1's step 10 (nothing else to train from) and trained step 11.
        assert list(per_rank["ep4"]) == [11] and torch.isfinite(torch.tensor(per_rank["ep4"][11]))


def test_dispatch_refuses_floating_point_counts_before_any_collective() -> None:
    from titan.parallel.expert_parallel import dispatch

    with pytest.raises(TypeError, match="integer token counts per expert, got torch.bfloat16"):
        dispatch(torch.zeros(4, 8), torch.tensor([1.0, 3.0]).to(torch.bfloat16), None, 2)  # type: ignore[arg-type]
