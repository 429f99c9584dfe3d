"""Muon on every layout reproduces Muon on one process (same global batch, 10 steps): the matrices
are orthogonalised whole, on one rank each, whatever shards them. float32 within 1e-5 of the loss
(as the AdamW layouts), bfloat16 parameters within bf16's tolerance. One spawned process group per
world size runs all of its layouts (llama3 and llama4, fp32 and bf16) in turn, with grad clipping
(on in the debug config), gradient accumulation and activation checkpointing among them."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.moe import LLAMA4, eptest_flavor
from tests.helpers.parity import FLAVORS, GLOBAL_BATCH, batches, config
from tests.helpers.reads import count, undo
from tests.helpers.tiny import extra_flavors
from titan.training.muon import Muon
from titan.training.trainer import Trainer

TOL = 1e-5
# bfloat16 parameters (FSDP's mixed precision: bf16 compute, fp32 master weights) against the fp32
# run: bf16 rounds each matmul input to 8 bits of mantissa (relative 2**-8); over 10 steps of a
# loss near 7.7 the curves stay within a few 1e-2.
BF16_TOL = 5e-2
MUON = ("--optimizer.name", "Muon")
SHARD = "--parallelism.data_parallel_shard_degree"
TP2 = ("--parallelism.tensor_parallel_degree", "2")
EP2 = ("--parallelism.expert_parallel_degree", "2")
BF16 = ("--training.mixed_precision_param", "bfloat16")
# The resumed runs feed the fixed batches themselves; their local batch size differs from FSDP 2's.
FRESH_LOADER = ("--checkpoint.exclude_from_loading", "dataloader")
# name -> (data-parallel degree, gradient accumulation, flags)
TWO = {
    "fsdp2": (2, 1, (SHARD, "2")),
    # Steps 1-3 only, step 3 quiet (no log): its host reads and collectives are counted. A quiet
    # step's loss is this rank's share (no all-reduce), so its curve is not compared.
    "fsdp2_quiet": (2, 1, (SHARD, "2", "--metrics.log_freq", "5")),
    "fsdp2_accum2_ac": (2, 2, (SHARD, "2", "--activation_checkpoint.mode", "full")),
    "tp2": (1, 1, (*TP2, SHARD, "1")),
    "pp2": (1, 1, ("--parallelism.pipeline_parallel_degree", "2", SHARD, "1")),
    "fsdp2_bf16": (2, 1, (SHARD, "2", *BF16)),
    "llama4_ep2": (2, 1, (*LLAMA4, SHARD, "2", *EP2)),
}
FOUR = {
    "hsdp2x2": (4, 1, ("--parallelism.data_parallel_replicate_degree", "2", SHARD, "2")),
    "fsdp2_tp2": (2, 1, (*TP2, SHARD, "2")),
    "fsdp2_tp2_bf16": (2, 1, (*TP2, SHARD, "2", *BF16)),
    "llama4_ep2_etp2": (2, 1, (*LLAMA4, *TP2, SHARD, "2", *EP2, "--parallelism.expert_tensor_parallel_degree", "2")),
}


def _trainer(dump: str, dp: int, accum: int, *flags: str) -> Trainer:
    batch = (
        "--training.local_batch_size",
        str(GLOBAL_BATCH // dp // accum),
        "--training.global_batch_size",
        str(GLOBAL_BATCH),
    )
    return Trainer(config(dump, *batch, *MUON, *flags))


# The collectives a step issues: FSDP's (all_gather_single / reduce_scatter_single), Muon's
# (all_to_all_single), the loss and grad norm's (all_reduce).
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce")


def _curve(trainer: Trainer, counts: Counter | None = None, first: int = 1, last: int = 10) -> list[float]:
    """Losses of steps first..last over the fixed batches (this rank's rows of each)."""
    dp = trainer.parallel_dims.dp_degree
    per, r = GLOBAL_BATCH // dp, trainer.dp_rank
    losses = []
    for step, (inputs, labels) in enumerate(batches(), start=1):
        if not first <= step <= last:
            continue
        trainer.train_state.step = step
        x, y = inputs[r * per : (r + 1) * per], labels[r * per : (r + 1) * per]
        n = trainer.grad_accum_steps
        patched: list = []
        if counts is not None and step == 3:
            count(counts, patched, COLLECTIVES)
        try:
            loss, _ = trainer.train_step(list(zip(x.chunk(n), y.chunk(n))))
        finally:
            undo(patched)
        losses.append(loss.item())
    return losses


def _owned(trainer: Trainer) -> dict[str, list[int]]:
    """fqn -> the matrices of that parameter this rank orthogonalised; "calls": Muon's collectives per step."""
    names = {id(p): n for part in trainer.model_parts for n, p in part.named_parameters()}
    out: dict = {"calls": 0}
    for opt in trainer.optimizers:
        if isinstance(opt, Muon):
            out["calls"] += opt.updates.calls_per_step
            for p in opt._params:
                out[names[id(p)]] = []
            for bucket in opt.updates.buckets:
                for u in bucket.units:
                    if u.owner == opt.updates.layouts[u.param].me:
                        out[names[id(opt._params[u.param])]] += list(range(u.first, u.first + u.count))
    return out


def _layouts(rank: int, world: int, dump: str, layouts: dict) -> dict:
    results: dict = {}
    with extra_flavors(**FLAVORS), eptest_flavor():
        for name, (dp, accum, flags) in layouts.items():
            trainer = _trainer(f"{dump}/{name}", dp, accum, *flags)
            if name.endswith("_quiet"):
                counts: Counter = Counter()
                _curve(trainer, counts, last=3)
                results["fsdp2_step3"] = dict(counts)
            else:
                results[name] = _curve(trainer)
            if name in ("fsdp2", "hsdp2x2"):
                results[f"{name}_owned"] = _owned(trainer)
            del trainer
        if "fsdp2" in layouts:  # Muon's state saved at FSDP 2 step 5, resumed at TP 2 (and, below, at 1 rank)
            ckpt = ("--checkpoint.enable", "--checkpoint.folder", "ckpt")
            saver = _trainer(f"{dump}/ckpt", 2, 1, SHARD, "2", *ckpt)
            _curve(saver, last=5)
            saver.checkpointer.save(5, blocking=True)
            saver.checkpointer.wait(final=True)
            del saver
            resumed = _trainer(f"{dump}/ckpt", 1, 1, *TP2, SHARD, "1", *ckpt, *FRESH_LOADER)
            assert resumed.step == 5
            results["tp2_resumed"] = _curve(resumed, first=6)
    return results


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[float]]:
    with extra_flavors(**FLAVORS), eptest_flavor():
        dump = str(tmp_path_factory.mktemp("ref"))
        return {
            "llama3": _curve(_trainer(f"{dump}/llama3", 1, 1)),
            "llama4": _curve(_trainer(f"{dump}/llama4", 1, 1, *LLAMA4)),
        }


def _check(results: list[dict], references: dict, layouts: dict) -> None:
    for name in (n for n in layouts if not n.endswith("_quiet")):
        ref = references["llama4" if name.startswith("llama4") else "llama3"]
        tol = BF16_TOL if name.endswith("bf16") else TOL
        for per_rank in results:
            worst = max(abs(a - b) for a, b in zip(per_rank[name], ref, strict=True))
            assert worst < tol, (name, per_rank[name], ref)


def _check_owners(results: list[dict], name: str, groups: list[list[int]]) -> None:
    """Within each group of ranks that share a matrix, every matrix is orthogonalised exactly once."""
    for fqn in (k for k in results[0][f"{name}_owned"] if k != "calls"):
        for ranks in groups:
            owned = [m for r in ranks for m in results[r][f"{name}_owned"][fqn]]
            assert sorted(owned) == list(range(len(owned))) and owned, (fqn, ranks, owned)


@pytest.mark.slow
def test_muon_two_rank_layouts_match_one_process(tmp_path, references) -> None:
    results = run_distributed(_layouts, 2, str(tmp_path), TWO, timeout=900)
    _check(results, references, TWO)
    # Saved at FSDP 2, resumed at TP 2 and at 1 rank: steps 6-10 as if never interrupted.
    with extra_flavors(**FLAVORS):
        flags = ("--checkpoint.enable", "--checkpoint.folder", "ckpt", *FRESH_LOADER)
        one = _trainer(str(tmp_path / "ckpt"), 1, 1, *flags)
        assert one.step == 5
        resumed = {"tp2": results[0]["tp2_resumed"], "1 rank": _curve(one, first=6)}
    for name, losses in resumed.items():
        assert max(abs(a - b) for a, b in zip(losses, references["llama3"][5:], strict=True)) < TOL, (name, losses)
    _check_owners(results, "fsdp2", [[0, 1]])
    step = results[0]["fsdp2_step3"]
    print("quiet FSDP 2 step with Muon, rank 0:", step)
    assert step.get("host reads", 0) == 0, step
    # Two all_to_alls per bucket (a few, not two per matrix); in bfloat16, the whole matrices'
    # elements at most (each sends its shard): a fraction of FSDP's fp32 all-gathers (forward and
    # backward) and reduce-scatter.
    matrices = len(results[0]["fsdp2_owned"]) - 1
    calls = results[0]["fsdp2_owned"]["calls"]
    assert step["all_to_all_single calls"] == calls and 4 * calls <= 2 * matrices, (step, calls)  # a quarter at most
    fsdp = step["all_gather_single bytes"] + step["reduce_scatter_single bytes"]
    assert step["all_to_all_single bytes"] < fsdp / 4, step


@pytest.mark.slow
def test_muon_four_rank_layouts_match_one_process(tmp_path, references) -> None:
    results = run_distributed(_layouts, 4, str(tmp_path), FOUR, timeout=900)
    _check(results, references, FOUR)
    _check_owners(results, "hsdp2x2", [[0, 1], [2, 3]])  # replicate 2 x shard 2: each shard pair
