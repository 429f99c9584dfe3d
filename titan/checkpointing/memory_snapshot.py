"""In-memory snapshots: a failed job restarts from the state of its last step, not its last
checkpoint on disk.

After every ``checkpoint.memory_interval`` steps (by default every step whose previous snapshot is
done everywhere) each rank copies its whole state (model and optimizer shards, LR schedulers,
train state, data loader position, RNG: the checkpoint's Stateful objects) into host memory that
outlives the process, ``checkpoint.memory_folder`` (``/dev/shm``), as files of two slots
(snapshot_store.py). The copy runs in a background thread: the step goes on, and only the next
optimizer step (the first thing to change the weights and optimizer state again) waits for the
copy to be done; the checksum, the manifest and the copy to the ring peer follow in the background.
With more than one node each rank then sends its snapshot to its ring peer on another node
(snapshot_budget.ring_offset), which keeps it: a node lost whole is restored from its peers.

On a (re)start every rank lists what its node holds, the ranks agree on the newest step that
every rank can restore from memory (its own snapshot, else a copy some rank holds: sent over the
network) and that is not older than the newest disk checkpoint (snapshot_transfer.plan), verify
the checksums, and restore it; otherwise they load the disk checkpoint as before. Disk
checkpoints keep their interval: snapshots never replace them. A run that ends (finished, or
stopped with its checkpoint saved) removes its snapshots; a failed one leaves them for its restart.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from titan.checkpointing import config_diff
from titan.checkpointing.snapshot_budget import host_budget, node_need, ring_offset, size_text
from titan.checkpointing.snapshot_restart import RankInfo, recover
from titan.checkpointing.snapshot_state import capture, create_optimizer_state, read
from titan.checkpointing.snapshot_store import (
    SnapshotFolder,
    copy_dir,
    digest,
    inventory,
    job_folder,
    new_manifest,
    own_dir,
    remove_if_empty,
    remove_job_folder,
)
from titan.checkpointing.snapshot_transfer import exchange
from titan.config.sections.checkpoint import Checkpoint as CheckpointConfig
from titan.errors import TitanError
from titan.log import logger

# The states whose tensors only the optimizer step changes: copied in the background.
LIVE = frozenset({"model", "optimizer"})


def node_id() -> str:
    """The node as the launcher numbers it (torchrun's GROUP_RANK), else the host's name."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


@dataclass
class _Job:
    step: int
    copied: threading.Event
    future: Future
    t0: float


class MemorySnapshots:
    """One per checkpoint manager, handed its Stateful dicts (read at each snapshot: states added
    later, e.g. a replica group's, are included) and a gloo group of its own (None: one process)."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        checkpoint_root: str,
        states: Mapping[str, Any],
        rank_states: Mapping[str, Any],
        rank: int,
        world_size: int,
        group: Any,
        config_record: dict[str, Any],
        device: torch.device | None,
    ) -> None:
        self.cfg, self.states, self.rank_states = cfg, states, rank_states
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = device or torch.device("cpu")
        self.root = job_folder(cfg.memory_folder, checkpoint_root)
        self.own = SnapshotFolder(own_dir(self.root, rank))
        self.held: SnapshotFolder | None = None
        self.peer_to = self.peer_from = None
        self.nodes: list[str] = [node_id()]
        self.config = digest(json.dumps(config_diff.relevant(config_record), sort_keys=True).encode())
        self.interval = 0  # settled by start()
        self.summary = "off (checkpoint.memory_interval = 0)" if cfg.memory_interval == 0 else "off"
        self._job: _Job | None = None
        self._hooks: list[Any] = []
        self.taken = self.skipped = 0
        self.seconds = 0.0
        self.nbytes = 0
        self._skip_noted = False

    # ------------------------------------------------------------ collectives
    def _gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _all_states(self) -> dict[str, Any]:
        return {**self.states, **self.rank_states}

    def _measure(self) -> tuple[str, int]:
        """This rank's snapshot layout digest and size in bytes, from its states as they are (a
        fresh optimizer's state is created first, as a checkpoint load does)."""
        create_optimizer_state(self._optimizers())
        cap = capture(read(self._all_states(), frozenset(self._all_states())))
        return cap.layout, cap.nbytes + len(cap.meta)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        container = self.states.get("optimizer")
        return [o for o in (container or []) if isinstance(o, torch.optim.Optimizer)]

    # ------------------------------------------------------------ start: ring, restore, size
    def start(self, disk_step: int, usable: bool) -> int | None:
        """On every rank together, before training: the ring, the restore (the step restored from
        memory, or None: load the disk checkpoint), the size check; what every rank holds and
        needs is gathered once. ``disk_step``: the newest disk checkpoint's step (-1: none);
        ``usable``: whether this start may resume from snapshots at all (not for a chosen
        checkpoint.load_step or a fresh start with job.overwrite)."""
        if self.cfg.memory_interval == 0:  # no rank of this job writes any: whatever an earlier run left goes
            shutil.rmtree(self.root, ignore_errors=True)
            return None
        # Reading a fresh optimizer's state dict creates its state (a step with zero gradients,
        # which counts as a step): a fresh start must not keep it.
        fresh = [o for o in self._optimizers() if not o.state]
        layout, nbytes = self._measure()
        budget = host_budget(self.cfg.memory_limit_gib, self.cfg.memory_folder, self.root)
        found = inventory(self.root) if usable else ([], [])
        ranks = [RankInfo(*r) for r in self._gather((node_id(), *found, layout, nbytes, budget))]
        self.nodes = [r.node for r in ranks]
        offset = ring_offset(self.nodes)
        if offset:
            self.peer_to, self.peer_from = ((self.rank + d) % self.world_size for d in (offset, -offset))
            self.held = SnapshotFolder(copy_dir(self.root, self.peer_from))
        restored = recover(self, disk_step, ranks) if usable else None
        self._purge(restored)
        if restored is None:
            for o in fresh:
                o.state.clear()
        self._settle(ranks, offset)
        return restored

    def _settle(self, ranks: list[RankInfo], offset: int) -> None:
        """Snapshots on when every node's fit in its host memory (each rank's budget for its node)."""
        for r in sorted({r.node: i for i, r in reversed(list(enumerate(ranks)))}.values()):
            need = node_need(self.nodes, [x.nbytes for x in ranks], ranks[r].node, offset)
            if need.total > ranks[r].budget.nbytes:
                what = (
                    f"in-memory snapshots need {need.text()}, {size_text(ranks[r].budget.nbytes)} is available"
                    f" ({ranks[r].budget.source})"
                )
                if self.cfg.memory_interval > 0:
                    e = TitanError(
                        f"checkpoint.memory_interval = {self.cfg.memory_interval}: {what}; valid: a"
                        " checkpoint.memory_limit_gib (or memory_folder) that holds them, or memory_interval 0 (off)"
                    )
                    e.same_on_all_ranks = True  # type: ignore[attr-defined]
                    raise e
                self.summary = f"off (checkpoint.memory_interval = -1: every step when they fit): {what}"
                return
        mine = ranks[self.rank]
        need = node_need(self.nodes, [x.nbytes for x in ranks], mine.node, offset)
        self.nbytes = mine.nbytes
        self.interval = max(self.cfg.memory_interval, 1)
        every = "every step" if self.cfg.memory_interval < 0 else f"every {self.interval} step(s)"
        peer = f", a copy on rank {self.peer_to} (node {self.nodes[self.peer_to]})" if self.peer_to is not None else ""
        self.summary = (
            f"{every} (in the background; skipped while the last is still copying), {size_text(mine.nbytes)} per"
            f" rank{peer}; {need.text()} of {size_text(mine.budget.nbytes)} ({mine.budget.source}) in {self.root}"
        )
        self._hooks = [o.register_step_pre_hook(self._before_optimizer_step) for o in self._optimizers()]

    def _purge(self, keep: int | None) -> None:
        """After the start: only the restored step's slots stay (or none), and the folders that no
        rank of this node keeps any more go (on its lowest rank, once every rank has read)."""
        self._barrier()
        self.own.drop(keep)
        if self.held is not None:
            self.held.drop(keep)
        node = self.nodes[self.rank] if len(self.nodes) == self.world_size else self.nodes[0]
        mine = [r for r in range(len(self.nodes)) if self.nodes[r] == node] or [self.rank]
        if self.rank == min(mine):
            keep_dirs = {os.path.basename(own_dir(self.root, r)) for r in mine}
            if self.peer_from is not None:
                offset = (self.rank - self.peer_from) % self.world_size
                keep_dirs |= {os.path.basename(copy_dir(self.root, (r - offset) % self.world_size)) for r in mine}
            remove_job_folder(self.root, keep_dirs)

    # ------------------------------------------------------------ every step
    def flags(self) -> tuple[int, int]:
        """(busy, failed) of the snapshot in flight, for the ranks' per-step agreement."""
        job = self._job
        if job is None or not job.future.done():
            return int(job is not None), 0
        return 0, int(job.future.exception() is not None)

    def after_step(self, step: int, busy: bool, failed: bool) -> None:
        """After the ranks agreed (any busy, any failed): take this step's snapshot, or not."""
        if not self.interval or step % self.interval:
            return
        if failed:
            self._disable()
            return
        if busy:
            self.skipped += 1
            if not self._skip_noted and self.rank == 0:
                self._skip_noted = True
                logger.info(f"in-memory snapshot of step {step} skipped: the last one is still being copied somewhere")
            return
        self._collect()
        t0 = time.perf_counter()
        state = read(self._all_states(), LIVE)  # the rest (the walk, the copy) in the background
        event = torch.cuda.Event() if self.device.type == "cuda" else None
        if event is not None:
            event.record()
        copied = threading.Event()
        future: Future = Future()

        def work() -> None:
            try:
                future.set_result(self._write(step, state, copied, event))
            except BaseException as e:  # reported by flags() at the next step
                future.set_exception(e)

        # a daemon thread: a ring copy stuck on a dead peer must not hold the process at exit
        threading.Thread(target=work, name=f"titan-snapshot-{step}", daemon=True).start()
        self._job = _Job(step, copied, future, t0)

    def _write(self, step: int, state: dict[str, Any], copied: threading.Event, event: Any) -> None:
        slot = self.own.next_slot()
        slot.invalidate()
        try:
            cap = capture(state)
            buffer = slot.buffer(cap.nbytes)
            if event is not None:  # after the step's kernels, on a stream of its own
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(stream):
                    stream.wait_event(event)
                    cap.copy_into(buffer)
                stream.synchronize()
            else:
                cap.copy_into(buffer)
        finally:
            copied.set()
        self.data_written(step)
        man = new_manifest(step, self.rank, cap.nbytes, slot.data_digest(), cap.meta, cap.layout, self.config)
        slot.write_meta(cap.meta)
        slot.commit(man)
        if self.held is not None and self.peer_to is not None and self.peer_from is not None:
            exchange([(self.peer_to, slot, man)], [(self.peer_from, self.held)], self.group)

    def data_written(self, step: int) -> None:
        """The data of step ``step`` is in memory, its manifest not yet (fault-injection tests stop here)."""

    def _before_optimizer_step(self, *args: Any) -> None:
        self.wait_copied()

    def wait_copied(self) -> None:
        """Until the snapshot in flight has copied the weights and optimizer state (before anything
        changes them: the optimizer step, a replica group's heal)."""
        if self._job is not None:
            self._job.copied.wait()

    def _collect(self) -> None:
        job, self._job = self._job, None
        if job is not None and job.future.done() and job.future.exception() is None:
            self.taken += 1
            self.seconds += time.perf_counter() - job.t0

    def _disable(self) -> None:
        job = self._job
        error = job.future.exception() if job is not None and job.future.done() else None
        self.interval = 0
        self.summary = "off after a failure"
        logger.warning(
            "in-memory snapshots off for the rest of this run: "
            + (f"{type(error).__name__}: {error}" if error is not None else "one failed on another rank")
        )

    # ------------------------------------------------------------ the end
    def close(self, remove: bool) -> None:
        """Wait for the snapshot in flight; ``remove`` (the run ended as it should): delete them."""
        if self._job is not None:
            try:
                self._job.future.result()
            except Exception:  # the run is over: a failed last snapshot only stays torn
                pass
            self._collect()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.rank == 0 and (self.taken or self.skipped):
            mean = self.seconds / max(self.taken, 1)
            logger.info(
                f"in-memory snapshots: {self.taken} taken ({mean:.2f} s each in the background), {self.skipped} skipped"
            )
        if remove:
            for folder in (self.own, self.held):
                if folder is not None:
                    folder.drop()
                    remove_job_folder(folder.folder, set())
            remove_if_empty(self.root)
        else:
            self.own.close()
            if self.held is not None:
                self.held.close()
