"""A start's choice among the in-memory snapshots, and the restore (titan/checkpointing/memory_snapshot.py).

Every rank has told the others what it sees (its node, the complete snapshots there, torn ones, its
layout digest, its size and its node's budget): ``recover`` plans the newest step every rank can
restore (snapshot_transfer.plan), has each rank's state read here or sent from the rank that keeps
it, checks it against its checksums (a damaged copy is passed over, and the plan made again
without it), then restores it on every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from titan.checkpointing.snapshot_budget import Budget
from titan.checkpointing.snapshot_state import restore
from titan.checkpointing.snapshot_store import Held, SnapshotFolder
from titan.checkpointing.snapshot_transfer import Plan, exchange, plan
from titan.log import logger


@dataclass(frozen=True)
class RankInfo:
    """What one rank told the others at the start."""

    node: str
    held: list[Held]  # the complete snapshots it sees
    torn: list[int]  # the ranks whose own folder it sees a torn slot in
    layout: str
    nbytes: int
    budget: Budget  # its node's host memory for snapshots


def recover(snaps: Any, disk_step: int, ranks: list[RankInfo]) -> int | None:
    """The step every rank restored from memory (``snaps``: the MemorySnapshots starting), or None."""
    t0 = time.perf_counter()
    held = [r.held for r in ranks]
    torn = sorted({t for r in ranks for t in r.torn})
    if torn and snaps.rank == 0:
        what = "were being written when they stopped (torn, no manifest): ignored"
        logger.warning(f"in-memory snapshot(s) of rank(s) {torn} {what}")
    if max((h.step for items in held for h in items), default=-1) < max(disk_step, 1):
        return None
    layouts = [r.layout for r in ranks]
    bad: set = set()
    for _ in range(3):
        chosen, why = plan(held, layouts, snaps.config, disk_step, frozenset(bad))
        if chosen is None:
            if snaps.rank == 0:
                disk = f"the disk checkpoint step-{disk_step}" if disk_step >= 0 else "scratch (no disk checkpoint)"
                logger.info(f"in-memory snapshots not used ({why}): starting from {disk}")
            return None
        loaded = _fetch(snaps, chosen)
        oks = snaps._gather(loaded is not None)
        if all(oks):
            break
        bad |= {(chosen.sources[r][0], r, chosen.step) for r, ok in enumerate(oks) if not ok}
    else:
        return None
    assert loaded is not None
    restore(snaps._all_states(), *loaded)
    moved = {r: h for r, (h, _) in chosen.sources.items() if h != r}
    via = f"; from peer copies: {', '.join(f'rank {r} <- rank {h}' for r, h in moved.items())}" if moved else ""
    logger.info(
        f"resumed from the in-memory snapshot of step {chosen.step} in {time.perf_counter() - t0:.2f} s{via}"
        + (f" (the disk checkpoint step-{disk_step} stays)" if disk_step >= 0 else "")
    )
    return chosen.step


def _fetch(snaps: Any, chosen: Plan) -> tuple[bytes, torch.Tensor] | None:
    """This rank's state of the chosen step, checked against its checksums: read here, or
    received from its holder (into this rank's own folder); None when damaged."""
    sends = []
    for r, (holder, h) in chosen.sources.items():
        if holder == snaps.rank and r != snaps.rank:
            slot = SnapshotFolder(h.folder).slots[h.slot]
            sends.append((r, slot, slot.manifest()))
    holder, h = chosen.sources[snaps.rank]
    recvs = [(holder, snaps.own)] if holder != snaps.rank else []
    got = exchange(sends, recvs, snaps.group) if snaps.group is not None and (sends or recvs) else []
    if recvs and got[0] is None:
        logger.warning(
            f"in-memory snapshot of step {chosen.step}: rank {holder} could not send rank {snaps.rank}'s copy"
        )
        return None
    slot, man = got[0] if recvs and got[0] is not None else (SnapshotFolder(h.folder).slots[h.slot], None)
    man = man or slot.manifest()
    try:
        if man is None or man.step != chosen.step:
            raise OSError("its manifest changed")
        data = slot.read_buffer(man.data_bytes)
        if slot.data_digest() != man.data_xxh:
            raise OSError(f"{slot.data_path} does not match its checksum")
        return slot.read_meta(man), data
    except OSError as e:
        logger.warning(f"in-memory snapshot of step {chosen.step} unusable on rank {snaps.rank}: {e}")
        return None
