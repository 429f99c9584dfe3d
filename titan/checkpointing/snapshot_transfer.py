"""Moving in-memory snapshots between ranks, and choosing the one every rank restarts from.

``exchange`` sends whole slots (manifest, meta, data) to other ranks and receives them into a
folder's next slot, over the snapshots' own gloo process group: the ring copy after each snapshot
(to the peer on another node) and, on a restart, a rank's state from whichever rank holds it.

``plan`` is the restart's decision, made identically on every rank from what all ranks hold: the
newest step that every rank can restore (from its own snapshot, or a copy some rank holds) and is
not older than the disk checkpoint; for each rank, where its state comes from.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan.checkpointing.snapshot_store import Held, Manifest, Slot, SnapshotFolder


@dataclass(frozen=True)
class Plan:
    step: int
    sources: dict[int, tuple[int, Held]]
    """rank -> (the rank that holds its state, the snapshot)."""


def plan(
    held: Sequence[Sequence[Held]], layouts: Sequence[str], config: str, disk_step: int, bad: frozenset = frozenset()
) -> tuple[Plan | None, str]:
    """``held[h]``: the complete snapshots rank h sees; ``layouts[r]``: rank r's layout digest;
    ``config``: this run's config digest; ``bad``: (holder, rank, step) found damaged. The plan, or
    None and why."""
    world = len(layouts)
    avail: dict[int, dict[int, list[tuple[int, Held]]]] = defaultdict(lambda: defaultdict(list))
    other = []
    for holder, items in enumerate(held):
        for h in items:
            if h.rank >= world or (holder, h.rank, h.step) in bad:
                continue
            if h.layout != layouts[h.rank] or h.config != config:
                other.append(h)
                continue
            avail[h.rank][h.step].append((holder, h))
    steps = set.intersection(*(set(avail[r]) for r in range(world))) if world else set()
    usable = [s for s in steps if s >= disk_step]
    if usable:
        step = max(usable)
        # the rank itself first (no transfer), its own folder before a copy, then the lowest holder
        sources = {r: min(avail[r][step], key=lambda x, r=r: (x[0] != r, not x[1].own, x[0])) for r in range(world)}
        return Plan(step, sources), ""
    if steps:
        return None, f"the newest that every rank holds (step {max(steps)}) is older than the disk checkpoint"
    if other and not avail:
        return None, "they were written by another model layout or a run with another training config"
    newest = max((s for r in avail for s in avail[r]), default=None)
    if newest is None:
        return None, "none is complete"
    missing = [r for r in range(world) if newest not in avail[r]]
    return None, f"step {newest} is missing for rank(s) {missing} and no older step is held for every rank"


def _send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, tag: int) -> dist.Work:
    work = dist.isend(tensor, dst=dst, group=group, tag=tag)
    assert work is not None
    return work


def _recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup, tag: int) -> dist.Work:
    work = dist.irecv(tensor, src=src, group=group, tag=tag)
    assert work is not None
    return work


def _read(slot: Slot, man: Manifest | None) -> list[torch.Tensor] | None:
    """A slot's manifest, meta and data as byte tensors to send; None when it cannot be read (the
    receiver then hears so instead of waiting for bytes that never come)."""
    try:
        if man is None:
            raise OSError("no manifest")
        text = torch.frombuffer(bytearray(json.dumps(man.__dict__).encode()), dtype=torch.uint8)
        meta = torch.frombuffer(bytearray(slot.read_meta(man)), dtype=torch.uint8)
        return [text, meta, slot.buffer_for_send(man.data_bytes)]
    except OSError:
        return None


def exchange(
    sends: Sequence[tuple[int, Slot, Manifest | None]],
    recvs: Sequence[tuple[int, SnapshotFolder]],
    group: dist.ProcessGroup,
) -> list[tuple[Slot, Manifest] | None]:
    """Send each (rank, slot, manifest) and receive, from each (rank, folder), a slot into that
    folder (committed with its sender's manifest once every byte arrived); the received slots
    (None where the sender could not read its own)."""
    bodies = [(dst, _read(slot, man)) for dst, slot, man in sends]
    out_heads = [
        (dst, torch.tensor([p.numel() for p in parts] if parts else [-1, 0, 0], dtype=torch.int64))
        for dst, parts in bodies
    ]
    in_heads = [(src, torch.zeros(3, dtype=torch.int64)) for src, _ in recvs]
    works = [_send(h, dst, group, 0) for dst, h in out_heads] + [_recv(h, src, group, 0) for src, h in in_heads]
    for w in works:
        w.wait()
    works, received = [], []
    for (src, folder), (_, head) in zip(recvs, in_heads):
        n_text, n_meta, n_data = (int(x) for x in head.tolist())
        if n_text < 0:
            received.append(None)
            continue
        slot = folder.next_slot()
        slot.invalidate()
        parts = [torch.empty(n_text, dtype=torch.uint8), torch.empty(n_meta, dtype=torch.uint8), slot.buffer(n_data)]
        works += [_recv(t, src, group, 1 + i) for i, t in enumerate(parts) if t.numel()]
        received.append((slot, parts))
    for dst, parts in bodies:
        works += [_send(t, dst, group, 1 + i) for i, t in enumerate(parts or []) if t.numel()]
    for w in works:
        w.wait()
    out: list[tuple[Slot, Manifest] | None] = []
    for item in received:
        if item is None:
            out.append(None)
            continue
        slot, (text, meta, _) = item
        man = Manifest(**json.loads(bytes(text.numpy())))
        slot.write_meta(bytes(meta.numpy()))
        slot.commit(man)
        out.append((slot, man))
    return out
