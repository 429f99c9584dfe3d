"""Parity runs: a layout's losses and grad norms against the 1-process run (fp32, same global batch).

The tiny flavors, the fixed batches, one Trainer run over them, every layout in turn on the ranks of
one spawned process group, and the comparison. Layouts that need different meshes share one process
group: each builds its Trainer in turn.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tiny import extra_flavors
from titan.config import load_config
from titan.models.llama.args import TransformerModelArgs
from titan.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
SEQ, VOCAB, STEPS, GLOBAL_BATCH = 32, 2048, 10, 4
TOL = 1e-4
# Tiny, 4 layers (2 or 4 pipeline stages), GQA with heads divisible by TP 2; 5 layers, which
# no pipeline degree splits evenly; 6 layers, the debug model's depth.
FLAVORS = {
    f"partest{suffix}": TransformerModelArgs(
        dim=64, n_layers=n, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32
    )
    for suffix, n in (("", 4), ("5", 5), ("6", 6))
}


def config(dump: str, *extra: str):
    return load_config(
        [
            "--job.config_file",
            str(REPO / "train_configs/debug_model.toml"),
            "--job.dump_folder",
            dump,
            "--model.flavor",
            "partest",
            "--training.seq_len",
            str(SEQ),
            "--metrics.enable_tensorboard",
            "false",
            # a second of fake forward/backward per build for a table row no parity test reads
            "--metrics.startup_memory_estimate",
            "false",
            "--lr_scheduler.warmup_steps",
            "1",
            *extra,
        ]
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def run(trainer: Trainer, steps: int | None = None) -> list[tuple[float, float]]:
    """(loss, grad norm) of every step over batches() (the first ``steps``), this rank's rows of each."""
    dp = trainer.parallel_dims.dp_degree
    per, r = GLOBAL_BATCH // dp, trainer.dp_rank
    out = []
    for inputs, labels in batches()[:steps]:
        x, y = inputs[r * per : (r + 1) * per], labels[r * per : (r + 1) * per]
        n = trainer.grad_accum_steps  # this rank's rows, cut into the accumulation micro-batches
        loss, norm = trainer.train_step(list(zip(x.chunk(n), y.chunk(n))))
        out.append((loss.item(), norm.item()))
    return out


def close(a: list, b: list, name: str, tol: float = 1e-5, relative: bool = False) -> float:
    """Per step (loss, grad norm) of ``a`` against ``b``: losses within ``tol`` (of ``b``'s loss if
    ``relative``), grad norms within 10x that; the worst loss difference."""

    def diff(x: float, y: float) -> float:
        return abs(x - y) / (abs(y) if relative else 1.0)

    worst = max(diff(x[0], y[0]) for x, y in zip(a, b, strict=True))
    assert worst < tol, (name, a, b)
    assert all(diff(x[1], y[1]) < 10 * tol for x, y in zip(a, b)), (name, a, b)
    return worst


def reference(dump: str, *flags: str) -> list[tuple[float, float]]:
    """The 1-process run (call with the flavors patched)."""
    return run(Trainer(config(dump, "--training.local_batch_size", str(GLOBAL_BATCH), *flags)))


def layouts_on_ranks(rank: int, world: int, dump: str, layouts: dict[str, tuple[str, ...]]):
    """For run_distributed: every layout's run, in turn, on this rank."""
    with extra_flavors(**FLAVORS):
        return run_layouts(dump, layouts)


def run_layouts(dump: str, layouts: dict[str, tuple[str, ...]]):
    results = {}
    for name, flags in layouts.items():
        dp = 1
        for key in ("--parallelism.data_parallel_shard_degree", "--parallelism.data_parallel_replicate_degree"):
            if key in flags:
                dp *= int(flags[flags.index(key) + 1])
        accum = 2 if name.endswith("_accum2") else 1
        batch = (
            "--training.local_batch_size",
            str(GLOBAL_BATCH // dp // accum),
            "--training.global_batch_size",
            str(GLOBAL_BATCH),
        )
        trainer = Trainer(config(dump, *batch, *flags))
        results[name] = run(trainer)
        del trainer
    return results


def check(results: list[dict], reference: list[tuple[float, float]], tol: float = TOL) -> dict[str, float]:
    """Every rank's run of every layout against the reference: loss within tol, grad norm within 10 tol."""
    diffs = {}
    for name in results[0]:
        worst = 0.0
        for per_rank in results:
            for (loss, norm), (ref_loss, ref_norm) in zip(per_rank[name], reference):
                worst = max(worst, abs(loss - ref_loss))
                assert abs(norm - ref_norm) < 10 * tol, (name, per_rank[name], reference)
        assert worst < tol, (name, results[0][name], reference)
        diffs[name] = worst
    print("max |loss - 1-process loss|:", diffs)
    return diffs
