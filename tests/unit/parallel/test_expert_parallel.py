"""Expert parallelism on a tiny llama4 (fp32, gloo ranks): each EP layout's losses and grad norms
against the same layout without EP, PP against the one-process run, the host reads of a quiet EP
step, and checkpoints that move between EP degrees. The layouts of one world size share one
spawned process group; each builds its Trainer in turn."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import GLOBAL_BATCH, VOCAB, batches, config
from titan.models import get_model_spec, register_flavor, register_model_spec
from titan.models.llama4.args import Llama4ModelArgs
from titan.models.moe import MoEArgs
from titan.training.trainer import Trainer

TOL = 1e-5
# Pipeline micro-batches sum the loss and gradients in another order than one process does: a few
# float32 ulps of the loss (1.3e-5 at a loss of about 7), not growing over the steps; so relative.
PP_RTOL = 1e-5
TITAN = Path(__file__).resolve().parents[3] / "titan"
# 4 layers, MoE in layers 1 and 3; 4 experts (EP 1, 2 or 4), top 2, a shared expert, bias balancing on.
EPTEST = Llama4ModelArgs(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=VOCAB,
    multiple_of=32,
    moe_args=MoEArgs(num_experts=4, top_k=2, num_shared_experts=1, load_balance_coeff=1e-2),
)
MOE_LAYERS = 2
EP2 = ("--parallelism.expert_parallel_degree", "2")
SHARD = "--parallelism.data_parallel_shard_degree"
USE_NEW = ("--checkpoint.config_mismatch", "use_new")  # 4 ranks: another local batch size
LLAMA4 = ("--model.name", "llama4", "--model.flavor", "eptest")


@contextlib.contextmanager
def eptest_flavor() -> Iterator[None]:
    saved = get_model_spec("llama4")
    try:
        register_flavor("llama4", "eptest", EPTEST, replace=True)
        yield
    finally:
        register_model_spec(saved, replace=True)


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


def _curve(trainer: Trainer, reads: dict[int, int] | None = None) -> list[tuple[float, float]]:
    """(loss, grad norm) per step over the fixed batches, this rank's rows of each."""
    dp = trainer.parallel_dims.dp_degree
    per, r = GLOBAL_BATCH // dp, trainer.dp_rank
    out = []
    for step, (inputs, labels) in enumerate(batches(), start=1):
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
        results[name] = _curve(_trainer(dump, dp, *flags), reads if name == "ep2" else None)
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


def on_two_ranks(rank: int, world: int, dump: str) -> dict:
    with eptest_flavor():
        reads: dict[int, int] = {}
        out = _layouts(
            f"{dump}/parity",
            {
                "fsdp2": (2, (SHARD, "2")),
                "ep2": (2, (SHARD, "2", *EP2)),
                "pp2": (1, ("--parallelism.pipeline_parallel_degree", "2", SHARD, "1")),
            },
            reads,
        )
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
        tp2 = ("--parallelism.tensor_parallel_degree", "2", SHARD, "2")
        out = _layouts(
            f"{dump}/parity4",
            {
                "fsdp4": (4, (SHARD, "4")),
                "ep2_fsdp2": (4, (SHARD, "4", *EP2)),
                "tp2": (2, tp2),
                "ep2_etp2": (2, (*tp2, *EP2, "--parallelism.expert_tensor_parallel_degree", "2")),
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


def test_pp2_reproduces_the_one_rank_curve(two, tmp_path) -> None:
    with eptest_flavor():
        # One sequence per forward, as the pipeline's micro-batches: the same matmul shapes.
        reference = _curve(_trainer(str(tmp_path), GLOBAL_BATCH))
    for per_rank in two[0]:
        _close(per_rank["pp2"], reference, "pp2", PP_RTOL, relative=True)


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
        _close(per_rank["ep2_etp2"], per_rank["tp2"], "ep2 x tp2 (etp 2)")
        # Loaded EP 1's step 10 (nothing else to train from) and trained step 11.
        assert list(per_rank["ep4"]) == [11] and torch.isfinite(torch.tensor(per_rank["ep4"][11]))
