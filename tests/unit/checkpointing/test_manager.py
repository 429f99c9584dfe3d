"""CheckpointManager inside real trainers, on gloo ranks: exact resume, layouts, seed, export.

One spawn of 2 ranks runs everything (process start-up dominates on 2 cores): first rank 0
alone (WORLD_SIZE=1 in its env: a 1-process trainer, no mesh, DCP with no_dist) writes a seed
checkpoint; then both ranks run 2-rank FSDP2/DDP trainers; then rank 0 alone again loads the
2-rank checkpoint and runs the 1-rank cases. N = 6 steps, resumed at 2 or 3: every mechanism
(interval and final saves, async overlap of the next steps, signal-stop, resume) happens within
6 steps, and each extra step costs ~0.3 s per trainer on 2 busy cores.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tests.helpers.distributed import run_distributed
from tests.helpers.runs import signal_during
from tests.helpers.runs import trainer as tiny_trainer

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _alone():
    """Run as a 1-process job on rank 0 while the 2-rank process group stays up."""
    saved = {k: os.environ[k] for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    try:
        yield
    finally:
        os.environ.update(saved)


def _probe(trainer, dp_rank: int, dp: int) -> tuple[float, float, float]:
    """Loss and grad norm of one training step on a fixed global batch (this rank's share), then the
    loss after that step: weights, optimizer moments and LR must all have been restored."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, trainer.model_parts[0].vocab_size, (4, 33), generator=g)
    mine = tokens[dp_rank * 4 // dp : (dp_rank + 1) * 4 // dp]
    batch = [(mine[:, :-1].contiguous(), mine[:, 1:].contiguous())]
    loss, norm = trainer.train_step(batch)
    after, _ = trainer.train_step(batch)
    return loss.item(), norm.item(), after.item()


def _complete(folder: Path, step: int) -> bool:
    return (folder / "checkpoint" / f"step-{step}" / "COMPLETE").is_file()


def _scenario(rank: int, world: int, tmp: str) -> dict:
    tmp_path = Path(tmp)
    out: dict = {}
    # --- seed checkpoint: 1 process, different seed than the runs that start from it
    if rank == 0:
        with _alone():
            tiny_trainer(tmp_path / "seed", "--checkpoint.create_seed_checkpoint", "--training.seed", "5").train()
            out["seed_complete"] = _complete(tmp_path / "seed", 0)
    dist.barrier()
    seed = str(tmp_path / "seed/checkpoint/step-0")

    # --- 2-rank FSDP2
    t = tiny_trainer(
        tmp_path / "a1", "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"
    )
    out["ref"] = t.train()
    out["ref_tokens"] = t.train_state.tokens_seen
    out["a1_steps"] = sorted(int(p.name[5:]) for p in (tmp_path / "a1/checkpoint").glob("step-*"))
    # stop by SIGTERM on rank 1 only during step 3: both ranks must save step 3 and stop
    t = tiny_trainer(tmp_path / "a2", "--checkpoint.enable", "--checkpoint.interval", "100")
    signal_during(t, 3, send=(rank == 1))
    out["a2_first"] = t.train()
    out["a2_step3"] = _complete(tmp_path / "a2", 3)
    t = tiny_trainer(tmp_path / "a2", "--checkpoint.enable", "--checkpoint.interval", "100")
    out["a2_resumed"] = t.train()
    out["a2_tokens"] = t.train_state.tokens_seen
    # resume from the step-2 save that was written in the background while step 3 ran
    if rank == 0:
        (tmp_path / "a3/checkpoint").mkdir(parents=True)
        shutil.copytree(tmp_path / "a1/checkpoint/step-2", tmp_path / "a3/checkpoint/step-2")
    dist.barrier()
    out["a3_resumed"] = tiny_trainer(
        tmp_path / "a3", "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"
    ).train()
    # same-layout probe of the step-3 checkpoint (full load through initial_load_path)
    probe = tiny_trainer(
        tmp_path / "a4",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(tmp_path / "a2/checkpoint/step-3"),
        "--checkpoint.initial_load_model_only",
        "false",
    )
    out["a4_step"] = probe.step
    out["probe2"] = _probe(probe, probe.dp_rank, 2)
    # seed checkpoint into two layouts: FSDP2 (auto-loaded from its own folder) and DDP (initial_load_path)
    if rank == 0:
        shutil.copytree(tmp_path / "seed/checkpoint", tmp_path / "s_fsdp/checkpoint")
    dist.barrier()
    out["seed_fsdp"] = tiny_trainer(tmp_path / "s_fsdp", "--checkpoint.enable", "--training.steps", "1").train()
    out["seed_ddp"] = tiny_trainer(
        tmp_path / "s_ddp",
        "--checkpoint.enable",
        "--training.steps",
        "1",
        "--checkpoint.initial_load_path",
        seed,
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ).train()
    dist.barrier()
    if rank == 1:
        return out

    # --- rank 0 alone: load the 2-rank FSDP2 checkpoint into 1 process
    with _alone():
        one = tiny_trainer(
            tmp_path / "b1",
            "--checkpoint.enable",
            "--checkpoint.initial_load_path",
            str(tmp_path / "a2/checkpoint/step-3"),
            "--checkpoint.initial_load_model_only",
            "false",
        )
        out["b1_step"] = one.step
        out["b1_loader"] = one.dataloader.state_dict()
        out["probe1"] = _probe(one, 0, 1)
        part = tiny_trainer(
            tmp_path / "b4",
            "--checkpoint.enable",
            "--checkpoint.initial_load_path",
            str(tmp_path / "a2/checkpoint/step-3"),
            "--checkpoint.initial_load_model_only",
            "false",
            "--checkpoint.exclude_from_loading",
            "dataloader,optimizer",
        )
        out["b4"] = (
            part.step,
            part.dataloader.state_dict()["streams"][0]["next"],
            any(o.state for o in part.optimizers),
        )
        # 1 rank, pinned-memory async mode, bf16 model-only export at the end, keep_latest_k=1
        b2 = tiny_trainer(
            tmp_path / "b2",
            "--checkpoint.enable",
            "--checkpoint.interval",
            "2",
            "--checkpoint.async_mode",
            "async_with_pinned_mem",
            "--checkpoint.last_save_model_only",
            "--checkpoint.export_dtype",
            "bfloat16",
            "--checkpoint.keep_latest_k",
            "1",
        )
        out["ref1"] = b2.train()
        out["b2_steps"] = sorted(p.name for p in (tmp_path / "b2/checkpoint").glob("step-*"))
        weights = {k: v.to(torch.bfloat16) for k, v in b2.model_parts[0].state_dict().items()}
        from titan.models.llama import Transformer

        fresh = Transformer(b2.model_parts[0].model_args)
        loaded = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in fresh.state_dict().items()}
        export = tmp_path / "b2/checkpoint/step-6"
        dcp.load(loaded, checkpoint_id=str(export), no_dist=True)
        fresh.load_state_dict(loaded)
        meta = dcp.FileSystemReader(str(export)).read_metadata().state_dict_metadata
        out["export_dtypes"] = {m.properties.dtype for m in meta.values()}
        out["export_equal"] = sorted(loaded) == sorted(weights) and all(
            torch.equal(loaded[k], weights[k]) for k in weights
        )
        out["export_fresh_ok"] = all(
            torch.equal(v.to(torch.bfloat16), weights[k]) for k, v in fresh.state_dict().items()
        )
        (tmp_path / "b3/checkpoint").mkdir(parents=True)
        shutil.copytree(tmp_path / "b2/checkpoint/step-4", tmp_path / "b3/checkpoint/step-4")
        out["b3_resumed"] = tiny_trainer(
            tmp_path / "b3", "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async"
        ).train()
    return out


def test_resume_layouts_seed_and_export(tmp_path):
    r0, r1 = run_distributed(_scenario, 2, str(tmp_path), timeout=600)
    ref = r0["ref"]
    assert sorted(ref) == list(range(1, 7))
    assert r0["ref"] == r1["ref"]
    # async interval saves at 2, 4 and the final one at 6
    assert r0["a1_steps"] == [2, 4, 6]

    # exact resume, 2-rank FSDP2, bitwise: signal-stop at 3 (sync), and resume from an async save
    assert sorted(r0["a2_first"]) == [1, 2, 3] == sorted(r1["a2_first"]), (r0["a2_first"], r1["a2_first"])
    assert r0["a2_step3"]
    assert r0["a2_resumed"] == {s: ref[s] for s in (4, 5, 6)}
    assert r0["a3_resumed"] == {s: ref[s] for s in (3, 4, 5, 6)}

    # 2-rank FSDP2 checkpoint -> 1 process: same step, same next-step numbers within 1e-5
    assert r0["a4_step"] == r0["b1_step"] == 3
    (loss2, norm2, after2), (loss1, norm1, after1) = r0["probe2"], r0["probe1"]
    assert abs(loss2 - loss1) < 1e-5 and abs(after2 - after1) < 1e-5, (r0["probe2"], r0["probe1"])
    # the grad norm sums 5.8M squared entries in a layout-dependent order (measured rel. diff 3e-5)
    assert abs(norm2 - norm1) < 1e-4 * norm1, (r0["probe2"], r0["probe1"])
    # exclude_from_loading: step restored, data loader from its start, optimizer state left empty
    assert r0["b4"] == (3, 0, False)
    assert r0["a2_tokens"] == r0["ref_tokens"] == 6 * 2 * 2 * 32
    loader = r0["b1_loader"]
    assert loader["dp_world_size"] == 1 and loader["streams"][0]["next"] > 0  # resharded, not fresh

    # seed checkpoint: FSDP2 and DDP start identically, and not from their own seed-0 init
    assert r0["seed_complete"]
    assert abs(r0["seed_fsdp"][1] - r0["seed_ddp"][1]) < 1e-5, (r0["seed_fsdp"], r0["seed_ddp"])
    assert abs(r0["seed_fsdp"][1] - ref[1]) > 1e-3

    # 1 rank: exact resume (bitwise) from a pinned-memory async save; keep_latest_k=1 kept the
    # newest full checkpoint (4) next to the model-only export (6)
    ref1 = r0["ref1"]
    assert sorted(ref1) == list(range(1, 7))
    assert r0["b3_resumed"] == {s: ref1[s] for s in (5, 6)}
    assert r0["b2_steps"] == ["step-4", "step-6"]
    # bf16 model-only export read back with plain DCP into a fresh model
    assert r0["export_dtypes"] == {torch.bfloat16}
    assert r0["export_equal"] and r0["export_fresh_ok"]
