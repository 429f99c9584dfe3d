"""Whether a job's in-memory snapshots fit the host memory of each node, and where a rank's ring
peer is.

A node keeps, for each of its ranks, two slots of the rank's own snapshot and, with peer copies,
two slots of the copy it keeps for its ring peer. That must fit the host memory the snapshots may
take: ``checkpoint.memory_limit_gib``, or else half of ``MemAvailable`` in ``/proc/meminfo`` at
start-up; and the free space of ``checkpoint.memory_folder`` (a tmpfs is sized on its own, by
default half the RAM), counting what this job's folder already holds there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from titan.checkpointing.snapshot_store import SLOTS

GIB = 1024**3


def size_text(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 1024**2:.1f} MiB"


def snapshot_host_bytes(state_bytes: float, peer_copy: bool = True) -> float:
    """Host memory (not the device's) one rank's snapshots take for ``state_bytes`` of state (its
    parameter and optimizer-state shards): two slots of its own, and two of its ring peer's copy
    (with more than one node). The memory estimate's row; a run measures its own at start-up."""
    return SLOTS * state_bytes * (2 if peer_copy else 1)


def ring_offset(nodes: Sequence[str]) -> int:
    """The smallest k such that every rank r's peer (r + k) mod N is on another node (with
    torchrun's numbering: the rank at the same place on the next node); 0 on one node."""
    n = len(nodes)
    for k in range(1, n):
        if all(nodes[r] != nodes[(r + k) % n] for r in range(n)):
            return k
    return 0


def meminfo_bytes(field: str, path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def folder_bytes(folder: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class Budget:
    nbytes: float
    source: str


def host_budget(limit_gib: float, memory_folder: str, job_folder: str) -> Budget:
    """The host memory one node's snapshots may take, and what says so."""
    if limit_gib > 0:
        budget = Budget(limit_gib * GIB, "checkpoint.memory_limit_gib")
    else:
        available = meminfo_bytes("MemAvailable")
        budget = Budget(available / 2, "half of MemAvailable in /proc/meminfo") if available else Budget(0, "")
    try:
        st = os.statvfs(memory_folder)
        free = st.f_bavail * st.f_frsize + folder_bytes(job_folder)
    except OSError:
        return budget
    if not budget.source or free < budget.nbytes:
        return Budget(free, f"free space of checkpoint.memory_folder {memory_folder}")
    return budget


@dataclass(frozen=True)
class NodeNeed:
    node: str
    ranks: int
    own: int  # bytes of one snapshot of each of its ranks (the largest)
    copies: int  # bytes of one peer copy it keeps per rank (the largest), 0 without peers
    total: int

    def text(self) -> str:
        copies = f" + peer copy {size_text(self.copies)}" if self.copies else ""
        return (
            f"{size_text(self.total)} on node {self.node} ({self.ranks} rank(s) x {SLOTS} slots x"
            f" (own {size_text(self.own)}{copies}))"
        )


def node_need(nodes: Sequence[str], sizes: Sequence[int], node: str, offset: int) -> NodeNeed:
    """Host memory ``node``'s snapshots take: its ranks' own, and the copies of their ring sources."""
    n = len(nodes)
    mine = [r for r in range(n) if nodes[r] == node]
    own = [sizes[r] for r in mine]
    copies = [sizes[(r - offset) % n] for r in mine] if offset else []
    total = SLOTS * (sum(own) + sum(copies))
    return NodeNeed(node, len(mine), max(own, default=0), max(copies, default=0), total)
