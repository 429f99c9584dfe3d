"""Checkpoints with torch.distributed.checkpoint (DCP): save, async save, resume, seed, export.

One ``CheckpointManager`` per trainer, handed two dicts of Stateful objects (states.py): ``states``
(model parts, optimizers, LR schedulers, train state) go through DCP, ``rank_states`` (RNG, data
loader position) into one file per rank beside the DCP files (rank_states.py); plus its checkpoint
section and the run's facts (dump folder, steps, world size, ranks). It never reads the trainer. A
checkpoint is ``<dump_folder>/<checkpoint.folder>/step-N``. DCP reshards on load, so any FSDP/DDP
layout reads any other's; a per-rank state of another layout is the object's own business.

Commit order (folders.py): rank 0 writes ``config.json`` (config_diff.py) into the empty folder,
every rank its ``rank_<r>.pt``, DCP every rank's files and ``.metadata``, rank 0 hashes every file
into ``MANIFEST.json`` (manifest.py), then writes ``COMPLETE``. A failed save (any rank, any
exception, DCP's BaseException-derived CheckpointException included) is explained in one line
(failure.py), its partial folder removed, and the run stops or, with ``on_save_error = "retry"``,
goes on to the next interval. Process groups: groups.py.

Async: ``async`` copies the state to the host, then writes it in a thread; ``async_with_pinned_mem``
also copies in the background (staging.py; the trainer calls ``wait_for_staging`` before its next
optimizer step). Only one save is in flight, so reused buffers are never overwritten.

In-memory snapshots (memory_snapshot.py): ``after_step`` takes one after each step, ``load``
resumes from them when they are as new as the newest checkpoint, ``finish`` removes them."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from titan.checkpointing import config_diff
from titan.checkpointing.failure import save_failure
from titan.checkpointing.folders import delete, prune, step_dir, write_marker
from titan.checkpointing.groups import CheckpointGroups
from titan.checkpointing.manifest import write_manifest
from titan.checkpointing.memory_snapshot import MemorySnapshots
from titan.checkpointing.preemption import PreemptionWatcher
from titan.checkpointing.preflight import (
    check_checkpoint_folder,
    checkpoint_bytes,
)
from titan.checkpointing.rank_states import write_rank_file
from titan.checkpointing.resume import RunStart, choose_intact
from titan.checkpointing.start_state import start_state
from titan.checkpointing.states import ModelParts
from titan.config.sections.checkpoint import Checkpoint as CheckpointConfig
from titan.errors import TitanError
from titan.log import logger
from titan.parallel.fsdp import DTYPES

__all__ = ["CheckpointManager"]


@dataclass
class _Pending:
    step: int
    path: str
    model_only: bool
    done: Future  # the upload, then (rank 0) the manifest
    staging: Future | None
    t0: float


class CheckpointManager:
    """Saves and loads the Stateful objects it is handed, by name: ``states`` through DCP (its
    "model" entry a ``ModelParts``: seed checkpoints, exports and weight-only loads use it alone),
    ``rank_states`` per rank. ``config_record`` is the run config written into every checkpoint
    (config_diff.snapshot). ``rank``, ``world_size``, ``dp_rank`` and ``dp_degree`` are this
    process's place in the layout; ``num_params`` sizes the disk preflight. ``start`` is what
    resume.prepare_run settled; without it (tests, tools) the checkpoint to resume from is chosen
    here."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        states: dict[str, Stateful],
        rank_states: dict[str, Stateful],
        dump_folder: str,
        overwrite: bool,
        total_steps: int,
        config_record: dict[str, Any],
        world_size: int,
        rank: int,
        dp_rank: int,
        dp_degree: int,
        num_params: int,
        start: RunStart | None = None,
    ) -> None:
        self.cfg = cfg
        model = states.get("model")
        if not isinstance(model, ModelParts):
            raise TypeError(f"states['model'] must be a ModelParts, got {type(model).__name__}")
        self.model, self.states, self.rank_states = model, dict(states), dict(rank_states)
        self.config_record = config_record
        self.total_steps = total_steps
        self.root = os.path.join(dump_folder, cfg.folder)
        self.world_size = world_size
        if cfg.create_seed_checkpoint and world_size != 1:
            raise TitanError(
                f"checkpoint.create_seed_checkpoint needs 1 process without parallelism; this run has "
                f"{world_size} ranks (run it with plain `python train.py`)"
            )
        self.rank, self.dp_rank, self.dp_degree = rank, dp_rank, dp_degree
        self.enabled = cfg.enable or cfg.create_seed_checkpoint
        snapshots = cfg.enable and not cfg.create_seed_checkpoint
        self.groups = CheckpointGroups.create(rank, world_size, self.enabled, snapshots and cfg.memory_interval != 0)
        # SIGTERM / SIGUSR1 stop every run after its step (with a save when checkpointing is on)
        self.watcher = PreemptionWatcher(self.groups.ctrl_pg, saving=cfg.enable)
        self.snapshots = None
        if snapshots:  # in-memory snapshots (off: they remove what an earlier run left)
            self.snapshots = MemorySnapshots(
                cfg,
                checkpoint_root=self.root,
                states=self.states,
                rank_states=self.rank_states,
                rank=rank,
                world_size=world_size,
                group=self.groups.snapshot_pg,
                config_record=config_record,
                device=next((p.device for part in model.parts for p in part.parameters()), None),
            )
        self.load_seconds = 0.0  # the state's load at start-up (snapshot or checkpoint)
        self.resumed = False
        # Called with the step before anything is written (the trainer's non-finite check: it may raise).
        self.before_save: Callable[[int], None] | None = None
        self._pending: _Pending | None = None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-ckpt-commit")
        self._stager = None
        if cfg.async_mode == "async_with_pinned_mem":
            from titan.checkpointing.staging import OwnedStager

            self._stager = OwnedStager()
        self.last_saved_step = -1
        self.overwrite = overwrite
        if self.enabled:
            need = checkpoint_bytes(num_params)
            self.groups.agree(lambda: check_checkpoint_folder(self.root, need))
        if start is None:
            resuming = cfg.enable and (cfg.load_step >= 0 or not overwrite)
            start = RunStart(
                found=self.groups.agree(lambda: choose_intact(self.root, cfg.load_step)) if resuming else None
            )
        self.start = start

    @property
    def snapshots_text(self) -> str:
        """In-memory snapshots: how often, how large, where (for the start-up table)."""
        return self.snapshots.summary if self.snapshots is not None else "off (checkpoint.enable is off)"

    # ------------------------------------------------------------------ when to save
    def next_save(self, step: int) -> int:
        """The first step after ``step`` that ends with a save: every ``interval`` steps, and the last."""
        return min((step // self.cfg.interval + 1) * self.cfg.interval, self.total_steps)

    def should_save(self, step: int) -> bool:
        """Whether training step ``step`` ends with a save (an interval save or the final one)."""
        return self.cfg.enable and step == self.next_save(step - 1)

    # ------------------------------------------------------------------ saving
    def _prepare_folder(self, path: str) -> None:
        """Remove an old folder of the same step (torn, damaged, or from an abandoned later
        timeline) before any rank writes into it, and record this run's config in it."""

        def prepare() -> tuple[int, str] | None:
            try:
                if os.path.exists(path):
                    logger.info(f"replacing existing {path}")
                    delete(path, ignore_errors=False)
                os.makedirs(path)
                config_diff.write_config(path, self.config_record)
            except OSError as e:  # every rank raises it, so all take the same failure path
                return e.errno or 0, e.strerror or str(e)
            return None

        failed = self.groups.agree(prepare)
        if failed is not None:
            raise OSError(*failed)

    def save(self, step: int, *, model_only: bool = False, blocking: bool = False, final: bool = False) -> None:
        if self.before_save is not None:
            self.before_save(step)
        self.wait()  # one save in flight at a time
        path = step_dir(self.root, step)
        t0 = time.perf_counter()
        try:
            self._prepare_folder(path)
            if model_only:
                dtype = DTYPES[self.cfg.export_dtype] if step > 0 else None
                state: dict[str, Any] = self.model.state_dict(dtype)
            else:
                # Before DCP's collectives: rank 0's manifest, written after them, lists every rank's file.
                rank_state = {name: s.state_dict() for name, s in self.rank_states.items()}
                self.groups.everywhere(lambda: write_rank_file(path, self.rank, rank_state))
                state = {name: s.state_dict() for name, s in self.states.items()}
            if self.cfg.async_mode == "disabled" or blocking:
                self.groups.dcp(state_dict_saver.save, state, path)
                if self.rank == 0:
                    write_manifest(path)
                self._commit(step, path, model_only, t0)
                return
            result = self.groups.dcp(state_dict_saver.async_save, state, path, async_stager=self._stager)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            self._save_failed(step, path, e, final or blocking)
            return
        upload, staging = (
            (result.upload_completion, result.staging_completion)
            if isinstance(result, AsyncSaveResponse)
            else (result, None)
        )
        # Hashing rank 0's view of the folder also runs off the training thread.
        done = self._finisher.submit(self._finish_upload, upload, path)
        self._pending = _Pending(step, path, model_only, done, staging, t0)
        logger.info(f"checkpoint step {step}: writing in the background (staged in {time.perf_counter() - t0:.2f} s)")

    def _finish_upload(self, upload: Future, path: str) -> None:
        upload.result()
        if self.rank == 0:
            write_manifest(path)

    def _commit(self, step: int, path: str, model_only: bool, t0: float) -> None:
        # DCP returns (or completes the future) only after the coordinator, rank 0, gathered every
        # rank's write results and wrote .metadata: rank 0's marker is the single commit point.
        if self.rank == 0:
            write_marker(path, step, model_only=model_only, world_size=self.world_size, dp_degree=self.dp_degree)
            prune(self.root, self.cfg.keep_latest_k)
        self.last_saved_step = step
        kind = "model-only " + self.cfg.export_dtype if model_only else "full"
        logger.info(f"checkpoint step {step} ({kind}) committed to {path} in {time.perf_counter() - t0:.2f} s")

    def wait_for_staging(self) -> None:
        """Block until a background copy of the last async save has finished (before parameters
        or optimizer state change again). A failed copy is reported by ``wait``."""
        if self._pending is not None and self._pending.staging is not None:
            try:
                self._pending.staging.result()
            except (Exception, CheckpointException):
                self.wait()

    def poll(self) -> None:
        if self._pending is not None and self._pending.done.done():
            self.wait()

    def wait(self, final: bool = False) -> None:
        """Finish (and commit) the save in flight, if any."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            if pending.staging is not None:
                pending.staging.result()
            pending.done.result()
            self._commit(pending.step, pending.path, pending.model_only, pending.t0)
        except (Exception, CheckpointException) as e:
            self._save_failed(pending.step, pending.path, e, final)

    def _save_failed(self, step: int, path: str, error: BaseException, final: bool) -> None:
        """Drop the partial folder (a full disk is freed again), keep every earlier checkpoint
        (pruning runs only after a commit), then stop with one line, or retry at the next interval."""
        if isinstance(error, TitanError):
            raise error
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        retry_at = self.next_save(step)
        message, advice = save_failure(error, path, self.root, step)
        if self.cfg.on_save_error == "retry" and not final:
            logger.warning(
                f"{message}; {advice}. checkpoint.on_save_error=retry: training goes on, next save at step {retry_at}"
            )
            return
        e = TitanError(f"{message}; {advice}, then restart to resume")
        e.same_on_all_ranks = True  # type: ignore[attr-defined]  # DCP gave every rank the same failure
        raise e from error

    # ------------------------------------------------------------------ training-loop hooks
    def install_signal_handlers(self) -> None:
        self.watcher.install()

    def save_if_due(self, step: int) -> None:
        """After training step ``step``: commit a finished async save, and the interval save (the
        last step's is finish()'s)."""
        if self.cfg.enable:
            self.poll()
            if self.should_save(step) and step < self.total_steps:
                self.save(step)

    def after_step(self, step: int) -> bool:
        """After the step's save and line: the ranks agree, in one collective, on a signal (True:
        the loop must stop, after a save with checkpointing on) and on the in-memory snapshot in
        flight; then this step's snapshot is taken, or not."""
        snapshots = self.snapshots
        stop, busy, failed = self.watcher.agree(*(snapshots.flags() if snapshots is not None else (0, 0)))
        if stop and self.cfg.enable:
            if self.last_saved_step == step or (self._pending is not None and self._pending.step == step):
                self.wait(final=True)  # this step's interval save: finished, not written twice
            else:
                self.save(step, blocking=True)
            logger.warning(f"checkpoint step {step} saved after a signal; stopping (exit 0)")
        elif snapshots is not None:
            snapshots.after_step(step, bool(busy), bool(failed))
        return bool(stop)

    def finish(self, step: int, preempted: bool) -> None:
        """At the end of training: the final save (model-only if configured), flush, clean up."""
        try:
            final_save = self.cfg.enable and not preempted and step > 0 and step != self.last_saved_step
            if final_save and not self.cfg.last_save_in_hf:
                self.save(step, model_only=self.cfg.last_save_model_only, final=True)
            self.wait(final=True)
            if final_save and self.cfg.last_save_in_hf:
                self._export_hf(step)
            if self.snapshots is not None:  # the run ended as it should: its snapshots go
                self.snapshots.close(remove=True)
                self.snapshots = None
        finally:
            if self.snapshots is not None:
                self.snapshots.close(remove=False)
            self.watcher.uninstall()
            if self._stager is not None:
                self._stager.shutdown()
                self._stager = None
            self._finisher.shutdown(wait=False)
            self.start.release()

    def _export_hf(self, step: int) -> None:
        """The final save as an HF folder at step-N (torchtitan's initial_load_in_hf path), committed as DCP's are."""
        from titan.checkpointing.hf import save_model_hf

        out, t0 = step_dir(self.root, step), time.perf_counter()
        if self.groups.agree(lambda: os.path.exists(out)):
            logger.info(f"replacing existing {out}")
            self.groups.agree(lambda: delete(out, ignore_errors=False))
        dtype, drop = DTYPES[self.cfg.export_dtype], self.cfg.hf_drop_routing_bias
        save_model_hf(self.model.parts, out, dtype=dtype, record=self.config_record, drop_routing_bias=drop)

        def commit() -> None:  # on rank 0; every rank returns once it is done (a next run may read it)
            write_manifest(out)
            write_marker(out, step, model_only=True, world_size=self.world_size, dp_degree=self.dp_degree, fmt="hf")
            prune(self.root, self.cfg.keep_latest_k)

        self.groups.agree(commit)
        self.last_saved_step = step
        logger.info(
            f"Hugging Face export of step {step} ({self.cfg.export_dtype}) written to {out} in"
            f" {time.perf_counter() - t0:.2f} s"
        )

    def create_seed_checkpoint(self) -> None:
        self.save(0, model_only=True, blocking=True, final=True)
        logger.info(
            f"seed checkpoint written to {step_dir(self.root, 0)}: start any layout from it with "
            f"checkpoint.enable (same folder) or checkpoint.initial_load_path"
        )
        self.start.release()

    # ------------------------------------------------------------------ loading
    def load(self) -> None:
        """Auto-resume from this run's newest state (in-memory snapshot or checkpoint folder), or
        start from initial_load_path, or start fresh; timed (``load_seconds``)."""
        t0 = time.perf_counter()
        try:
            start_state(self)
        finally:
            self.load_seconds = time.perf_counter() - t0
