"""This process's replica group among the others, through torchft's Manager.

The trainer asks one question per step: was it committed (every live group applies it) or
discarded (no group does)? Around it:

- ``start_step``: the quorum of live groups for this step starts (in the background while the
  forward runs); a group that is behind (restarted) fetches the current weights, optimizer and
  LR-scheduler state and step from a live peer over torchft's checkpoint transport.
- ``sync_gradients``: the gradients are averaged over the groups of the quorum (one flat
  all-reduce per dtype), then torchft decides: committed, or discarded because a group failed
  during the step (its collectives errored or timed out) or too few groups took part.
- the group's data position is its own, kept per step (titan/ft/data_position.py).
- a group whose first quorum (at its first attempt) holds another live group under its replica id
  stops with one line (torchft itself tells the two apart by a random suffix and would train both).

Inside a group the layout is titan's own (FSDP, TP, PP, CP): rank r of every group holds the same
shards, and torchft's process group joins rank r of every group.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore
from torch.distributed.tensor import DTensor

from titan.config.sections.fault_tolerance import FaultTolerance
from titan.errors import TitanError
from titan.ft.data_position import DataPosition
from titan.ft.preflight import lighthouse_address
from titan.ft.semi_sync import SemiSync
from titan.ft.torchft_log import route_torchft_logs
from titan.ft.transfer import like, to_local
from titan.log import logger

REPLICA_PREFIX = "titan_replica_"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class ReplicaRecord:
    """What the replica-group machinery did in this process: for the goodput record."""

    committed: int = 0  # semi-synchronous methods: inner steps (applied locally)
    discarded: int = 0
    heals: int = 0
    heal_seconds: float = 0.0  # loading the peer's state (its transfer: in the quorum, before or during the forward)
    synced: int = 0  # semi-synchronous methods: synchronizations committed ...
    sync_failed: int = 0  # ... and failed (the fragment went back to its last global weights)


class ReplicaGroups:
    """One replica group's seat in torchft's quorum. ``states`` are the Stateful objects a healing
    group takes from its peer (model, optimizer, LR schedulers, train state: everything but the data
    loader and RNG, which stay the group's own)."""

    def __init__(
        self,
        cfg: FaultTolerance,
        states: dict[str, Any],
        rank_states: dict[str, Any],
        device: torch.device,
        data: DataPosition | None = None,
        log_folder: str = "",
        rank: int = 0,
    ):
        # torchft's own lines go to a file in the dump folder, set up before torchft is imported
        # (its Rust logger reads its level then).
        self.log_path = route_torchft_logs(log_folder, cfg.replica_id, rank) if log_folder else ""
        # A peer's state arrives as read-only bytes that torch wraps without copying; it is only
        # read (load_state_dict copies it into this group's tensors), so torch's warning says nothing.
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, "torch.distributed")
        import torchft  # the titan[ft] extra; checked with one line by check_torchft

        # imports torchft too: after route_torchft_logs, whose RUST_LOG torchft reads at its import
        from titan.ft.process_group import replica_process_group

        self.cfg, self.states, self.device, self.data = cfg, dict(states), device, data
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.resumed = False  # from this group's own checkpoint or in-memory snapshot (after_load)
        self.before_heal: Any = None  # called before a peer's state overwrites this group's
        self.record = ReplicaRecord()
        self.committed = True
        self._params: list[torch.nn.Parameter] = []
        self._first_quorum = True
        self._when = "in the step's commit"  # where a heal is applied (see _heal_before_forward)
        self.url = url = lighthouse_address()
        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        backend = cfg.process_group
        if backend == "nccl" and device.type != "cuda":
            logger.info("fault_tolerance.process_group = nccl needs CUDA: replica groups use gloo on this CPU machine")
            backend = "gloo"
        pg = replica_process_group(backend, timeout)
        # The group's ranks find their torchft manager through a store: the launcher's when the
        # group has a process group; a one-rank group has none, so this rank hosts one.
        where: dict[str, Any] = {}
        if not dist.is_initialized():
            self._store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
            host = os.environ.get("MASTER_ADDR", "localhost")
            where = {"store_addr": host, "store_port": self._store.port, "rank": 0, "world_size": 1}
        self.manager = torchft.Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=cfg.min_replica_size,
            # Semi-synchronous methods take their quorum at each synchronization, not every step.
            use_async_quorum=cfg.semi_sync_method == "none",
            replica_id=f"{REPLICA_PREFIX}{cfg.replica_id}",
            lighthouse_addr=url,
            timeout=max(timeout, timedelta(seconds=30)),
            # Every group builds the same seeded weights: step 0 needs no transfer. (It would also
            # make the sender create its optimizer state in the quorum thread, mid-forward.)
            init_sync=False,
            **where,
        )
        self.manager.register_state_dict_fn("titan", self._load_peer_state, self._peer_state)
        # torchft keeps each quorum's member ids to itself: its client is wrapped to show them.
        cast(Any, self.manager)._client = FirstQuorumCheck(self.manager._client, self)
        states["fault_tolerance"] = self  # saved with this group's checkpoints (not sent to peers)
        self.semi_sync: SemiSync | None = None
        if cfg.semi_sync_method != "none":
            parts, optimizers = states["model"].parts, list(states["optimizer"])
            if len(parts) != 1 or len(optimizers) != 1:
                raise TitanError(
                    f"config key 'fault_tolerance.semi_sync_method' = {cfg.semi_sync_method!r} needs one model part"
                    " with one optimizer (no pipeline parallelism, no optimizer in backward) in each replica group"
                )
            self.semi_sync = SemiSync(cfg, self.manager, parts[0], optimizers[0])
            self._count_syncs()
            rank_states["semi_sync"] = self.semi_sync  # each rank's shards of the outer state
        logs = f"; torchft's log: {self.log_path}" if self.log_path else ""
        logger.info(
            f"replica group {cfg.replica_id} of {cfg.groups} joined the lighthouse at {url}"
            f" (min_replica_size {cfg.min_replica_size}, {backend} between groups{logs})"
        )

    def _count_syncs(self) -> None:
        """torchft's LocalSGD / DiLoCo ask the manager whether each synchronization commits: the
        answers go to the goodput record."""
        should_commit = self.manager.should_commit

        def counted(*args: Any, **kwargs: Any) -> bool:
            ok = should_commit(*args, **kwargs)
            if ok:
                self.record.synced += 1
            else:
                self.record.sync_failed += 1
            return ok

        cast(Any, self.manager).should_commit = counted

    # ------------------------------------------------------------ healing
    def _peer_state(self) -> dict[str, Any]:
        return {name: to_local(s.state_dict()) for name, s in self.states.items()}

    def _load_peer_state(self, received: Any) -> None:
        t0 = time.perf_counter()
        if self.before_heal is not None:  # an in-memory snapshot may still be copying these tensors
            self.before_heal()
        # torch's optimizer state-dict functions create a fresh optimizer's state (one step with
        # zero gradients) only when no parameter holds a gradient: the step's averaged gradients
        # are set aside while the peer's state is loaded, then used for the step's update.
        grads = [(p, p.grad) for p in self._params]
        for p, _ in grads:
            p.grad = None
        try:
            for name, state in self.states.items():
                state.load_state_dict(like(state.state_dict(), received[name]))
        finally:
            for p, g in grads:
                p.grad = g
        self.record.heals += 1
        self.record.heal_seconds += time.perf_counter() - t0
        again = f" (restart {self.restart})" if self.restart else ""
        logger.info(
            f"replica group {self.cfg.replica_id}{again} healed from a live peer at step {self._train_step}"
            f" ({self._when}): the peer's weights, optimizer and lr schedule; training goes on from there"
        )

    @property
    def _train_step(self) -> int:
        return int(self.states["train_state"].state_dict()["step"])

    # ------------------------------------------------------------ one step
    def start_step(self) -> None:
        """Before the forward: the quorum of live groups for this step (a group that is behind
        heals from a peer before the step's update). The process's first quorum is awaited here,
        so a replica id in use stops the group before it trains. Semi-synchronous methods take
        theirs at each synchronization instead."""
        if self.semi_sync is None:
            first = self._first_quorum
            self.manager.start_quorum()
            if first:
                self.manager.wait_quorum()
                self._heal_before_forward()

    def _heal_before_forward(self) -> None:
        """A heal that the awaited first quorum brings is applied now, while the main thread waits
        anyway, as torchft does in its synchronous mode (``use_async_quorum=False``), rather than in
        ``should_commit`` after the backward: the group holds its peer's state a step sooner, and its
        step runs on it. torchft counts in a step only the groups that were at its max step when the
        quorum formed, so the healed group still sends zeros this step and its update is the live
        groups' average, as before (bitwise their state). A failed transfer leaves nothing pending
        and errors the step (discarded), as in should_commit."""
        manager = cast(Any, self.manager)  # torchft keeps the pending heal private
        if manager._healing:
            self._when = "before the step's forward"
            manager._apply_pending_state_dict()
            self._when = "in the step's commit"
            manager._healing = False

    def check_quorum(self, replica_ids: list[str], heal: bool = False) -> None:
        """This process's first quorum (``replica_ids``: torchft's ``<id>:<random suffix>``): at a
        group's first attempt a second member under its id is another live group launched with the
        same fault_tolerance.replica_id. A restarted group's may be its own previous process, killed
        while it waited for a quorum: the lighthouse counts it until its heartbeat times out, and
        torchft's suffix is there to tell the two apart (the step fails on the dead member and is
        discarded; the next quorum is without it). A restarted group that does not ``heal`` (no
        live peer is ahead of it) says where it goes on from."""
        if not self._first_quorum:
            return
        self._first_quorum = False
        mine = f"{REPLICA_PREFIX}{self.cfg.replica_id}:"
        if self.restart and not heal:
            where = "its own checkpoint" if self.resumed else "scratch (no checkpoint of its own)"
            # alone: every other group finished (or is down); it trains the steps it lacks by itself
            others = any(not r.startswith(mine) for r in replica_ids)
            peers = "no live peer is ahead of it" if others else "no live peer"
            logger.info(
                f"replica group {self.cfg.replica_id} (restart {self.restart}): {peers};"
                f" it trains on from {where} at step {self._train_step}"  # the step in flight
            )
        same = [r for r in replica_ids if r.startswith(mine)]
        if len(same) > 1 and not self.restart:
            raise TitanError(
                f"config key 'fault_tolerance.replica_id' = {self.cfg.replica_id} is already used by another live"
                f" replica group at the lighthouse {self.url}; valid: an id no other group uses, 0 .."
                f" {self.cfg.groups - 1} (fault_tolerance.group_size = {self.cfg.group_size})"
            )

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> bool:
        """After the backward: average the gradients over the quorum's groups and ask torchft
        whether the step commits. A discarded step drops every gradient, so the optimizer step
        that follows changes no weight and no optimizer state; like a non-finite skipped step it
        still counts (step number and LR schedule stay aligned across groups)."""
        self._params = params  # a heal (inside should_commit) sets their gradients aside
        if self.data is not None:
            self.data.save(self._train_step)
        if self.semi_sync is not None:
            self.record.committed += 1
            return True  # inner steps are local; torchft synchronizes after the optimizer step
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for g in grads:
            buckets.setdefault((g.dtype, g.device), []).append(g)
        for bucket in buckets.values():
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self.manager.allreduce(flat).wait()
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self.committed = self.manager.should_commit()
        if self.committed:
            self.record.committed += 1
            return True
        for p in params:
            p.grad = None
        # torchft counts committed steps; titan counts this one too (step number, LR schedule). Its
        # count moves with titan's, so a quorum compares train steps: a restarted group whose own
        # snapshot is older than the live groups heals even when they only discarded steps meanwhile
        # (else it would train on a step behind them, and on alone after they finished).
        count = self.manager.state_dict()
        self.manager.load_state_dict({**count, "step": count["step"] + 1})
        self.record.discarded += 1
        logger.warning(
            f"replica group {self.cfg.replica_id}: step {self._train_step} discarded (a replica group failed"
            " or too few took part): no update applied; training goes on"
        )
        return False

    # ------------------------------------------------------------ this group's checkpoint
    def after_load(self, checkpointer: Any) -> None:
        """After the group's own checkpoint (if any) was loaded: its data reads on from its last
        step when that is newer (a restart)."""
        self.resumed = checkpointer.resumed
        if self.data is None:
            return
        ckpt = checkpointer.cfg
        self.data.restore(
            self._train_step,
            resumed=self.resumed or self.restart > 0,
            load_step=ckpt.load_step,
            excluded="dataloader" in ckpt.exclude_from_loading,
        )

    def state_dict(self) -> dict[str, Any]:
        """torchft's step count (titan's train step: discarded steps count, see sync_gradients): a
        restarted group resumes it, so it is never ahead of the live groups (the group furthest on
        is the one the others heal from)."""
        return self.manager.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.manager.load_state_dict({k: int(v) for k, v in state_dict.items()})

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class FirstQuorumCheck:
    """torchft's manager client with this process's first quorum result checked by the group."""

    def __init__(self, client: Any, group: ReplicaGroups) -> None:
        self._client, self._group = client, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, **kwargs: Any) -> Any:
        quorum = self._client._quorum(**kwargs)
        self._group.check_quorum(list(quorum.replica_ids), heal=bool(quorum.heal))
        return quorum


class NoReplicaGroups:
    """fault_tolerance.enable = false: every step commits, nothing is exchanged."""

    committed = True
    record = None

    def start_step(self) -> None:
        return None

    def after_load(self, checkpointer: Any) -> None:
        return None

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> bool:
        return True


Replicas = ReplicaGroups | NoReplicaGroups


def join_replica_groups(
    cfg: FaultTolerance, checkpointer: Any, device: torch.device, log_folder: str = ""
) -> ReplicaGroups | NoReplicaGroups:
    """This process's replica group (or none without fault_tolerance.enable). ``checkpointer``: the
    checkpoint manager, whose Stateful objects (``states``, ``rank_states``) a healing group takes
    from its peer; the group's own torchft record and semi-synchronous state are added to them.
    ``log_folder``: where torchft's own log lines go (the job's dump folder). torchft and the
    lighthouse were checked by check_torchft (titan/ft/preflight.py) before anything was built."""
    if not cfg.enable:
        return NoReplicaGroups()
    data = DataPosition(checkpointer.root, checkpointer.rank, checkpointer.rank_states["dataloader"])
    rank = checkpointer.rank
    groups = ReplicaGroups(cfg, checkpointer.states, checkpointer.rank_states, device, data, log_folder, rank)
    snapshots = getattr(checkpointer, "snapshots", None)
    groups.before_heal = snapshots.wait_copied if snapshots is not None else None
    return groups
