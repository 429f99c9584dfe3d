"""What a run does with its dump folder before it builds or writes anything.

``prepare_run`` is called once the process group exists and before the model, the metrics
writers or the checkpoint manager: rank 0 takes the dump folder's lock, picks the checkpoint to
resume from (verifying its manifest, falling back to older intact ones) and compares its config
with this run's; every rank gets the same answer (or the same error) by one broadcast, and a
``use_checkpoint`` decision changes the config on every rank before anything is built from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from titan.checkpointing import config_diff
from titan.checkpointing.folders import Found, resume_candidates
from titan.checkpointing.lock import RunLock
from titan.checkpointing.manifest import verify
from titan.errors import TitanError
from titan.log import logger


@dataclass
class RunStart:
    lock: RunLock | None = None
    found: Found | None = None
    # 'section.key' -> (checkpoint's value, this run's value) that checkpoint.config_mismatch settled.
    config_diff: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def choose_intact(root: str, load_step: int) -> Found | None:
    """The first candidate whose files match its manifest; one warning per damaged one skipped."""
    candidates = resume_candidates(root, load_step)
    damaged = []
    for f in candidates:
        problem = verify(f.path)
        if problem is None:
            return f
        if load_step >= 0:
            raise TitanError(
                f"checkpoint.load_step {load_step}: {f.path} is damaged: {problem}; pick another step"
                " with --checkpoint.load_step N (add --job.overwrite true to replace later ones)"
            )
        damaged.append(f.path)
        logger.warning(
            f"checkpoint {f.path} is damaged: {problem}; skipping it and trying the next older one"
            " (--checkpoint.load_step N --job.overwrite true loads a chosen step)"
        )
    if damaged:
        raise TitanError(
            f"no intact checkpoint in {root} (damaged: {', '.join(damaged)}); restore one from a backup,"
            " or start from scratch with --job.overwrite true (deletes them)"
        )
    return None


def agree(decide: Callable[[], Any], rank: int, group: Any) -> Any:
    """Rank 0 decides (it scans the folder); every rank of ``group`` gets its answer or its error
    (``group`` None: one process)."""
    result: list[Any] = [None]
    if rank == 0:
        try:
            result[0] = ("ok", decide())
        except TitanError as e:
            result[0] = ("error", str(e))
    if group is not None:
        dist.broadcast_object_list(result, src=0, group=group)
    status, value = result[0]
    if status == "error":
        error = TitanError(value)
        error.same_on_all_ranks = True  # type: ignore[attr-defined]  # train.py prints it once
        raise error
    return value


def prepare_run(config: Any, rank: int, world_size: int, dp_degree: int) -> RunStart:
    """Lock the dump folder and settle what to resume from (see the module docstring)."""
    lock = RunLock(config.job.dump_folder)
    cfg = config.checkpoint
    resuming = cfg.enable and not cfg.create_seed_checkpoint and (cfg.load_step >= 0 or not config.job.overwrite)
    root = os.path.join(config.job.dump_folder, cfg.folder)

    def decide() -> tuple[Found | None, dict]:
        lock.acquire()
        try:
            found = choose_intact(root, cfg.load_step) if resuming else None
            diff = {}
            if found is not None and not found.model_only:
                diff = config_diff.resolve(
                    found.path, config_diff.snapshot(config, dp_degree), cfg.config_mismatch, cfg.exclude_from_loading
                )
        except BaseException:
            lock.release()
            raise
        return found, diff

    found, diff = agree(decide, rank, dist.group.WORLD if world_size > 1 else None)
    if cfg.config_mismatch == "use_checkpoint":
        config_diff.apply(config, diff)
    return RunStart(lock if lock.mine is not None else None, found, diff)
