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
optimizer step). Only one save is in flight, so reused buffers are never overwritten."""

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
from titan.checkpointing.failure import explain
from titan.checkpointing.folders import delete, prune, scan, step_dir, write_marker
from titan.checkpointing.groups import CheckpointGroups
from titan.checkpointing.loading import (
    hyperparameters,
    load_full,
    load_model_only,
    raise_missing,
    restore_hyperparameters,
)
from titan.checkpointing.manifest import write_manifest
from titan.checkpointing.preemption import PreemptionWatcher
from titan.checkpointing.preflight import (
    check_checkpoint_folder,
    check_no_later_checkpoints,
    checkpoint_bytes,
    clear_for_fresh_start,
)
from titan.checkpointing.rank_states import write_rank_file
from titan.checkpointing.resume import RunStart, choose_intact
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
        self.groups = CheckpointGroups.create(rank, world_size, self.enabled)
        self.watcher = PreemptionWatcher(self.groups.ctrl_pg) if cfg.enable else None
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
        cause, advice = explain(error, path)
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        newest = next((f"step-{f.step}" for f in reversed(scan(self.root)) if f.complete), None)
        kept = (
            f"earlier checkpoints in {self.root} are intact (newest: {newest})"
            if newest
            else f"no earlier checkpoint in {self.root}"
        )
        message = f"checkpoint step {step}: writing {path} failed: {cause}; the partial folder was removed, {kept}"
        retry_at = self.next_save(step)
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
        if self.watcher is not None:
            self.watcher.install()

    def after_step(self, step: int) -> bool:
        """Interval save, async commit, preemption. Returns True when the loop must stop."""
        if not self.cfg.enable:
            return False
        self.poll()
        stop = self.watcher.should_stop() if self.watcher is not None else False
        if stop:
            self.save(step, blocking=True)
            logger.warning(f"checkpoint step {step} saved after a signal; stopping (exit 0)")
        elif self.should_save(step) and step < self.total_steps:  # the last step's save is finish()'s
            self.save(step)
        return stop

    def finish(self, step: int, preempted: bool) -> None:
        """At the end of training: the final save (model-only if configured), flush, clean up."""
        try:
            final_save = self.cfg.enable and not preempted and step > 0 and step != self.last_saved_step
            if final_save and not self.cfg.last_save_in_hf:
                self.save(step, model_only=self.cfg.last_save_model_only, final=True)
            self.wait(final=True)
            if final_save and self.cfg.last_save_in_hf:
                self._export_hf(step)
        finally:
            if self.watcher is not None:
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
        """Auto-resume from this run's folder, or start from initial_load_path, or start fresh."""
        cfg, agree = self.cfg, self.groups.agree
        if not cfg.enable or cfg.create_seed_checkpoint:
            return
        found = self.start.found
        if found is not None and cfg.load_step >= 0:
            agree(lambda: check_no_later_checkpoints(found, self.root, self.overwrite))
        elif self.overwrite and cfg.load_step < 0:
            gone = agree(lambda: clear_for_fresh_start(self.root))
            if gone:
                logger.warning(f"job.overwrite: deleted the earlier checkpoints {gone}; starting from scratch")
        if found is not None:
            if found.model_only:
                logger.info(f"starting from the seed checkpoint {found.path} (model weights only)")
                load_model_only(found.path, self.model, self.groups)
            else:
                self._load_full(found.path)
                logger.info(f"resumed from {found.path}: step {self._step()}")
            self.last_saved_step = found.step
            return
        path = cfg.initial_load_path
        if not path:
            logger.info(f"no checkpoint in {self.root}: starting from scratch")
            return
        if cfg.initial_load_in_hf:
            from titan.checkpointing.hf import load_hf_into_model

            load_hf_into_model(self.model.parts, path)
            logger.info(f"loaded Hugging Face weights from checkpoint.initial_load_path {path}")
            return
        agree(lambda: os.path.isfile(os.path.join(path, ".metadata")) or raise_missing(path))
        if cfg.initial_load_model_only:
            load_model_only(path, self.model, self.groups)
            logger.info(f"loaded model weights from checkpoint.initial_load_path {path}")
        else:
            self._load_full(path)
            logger.info(f"loaded checkpoint.initial_load_path {path}: step {self._step()}")

    def _load_full(self, path: str) -> None:
        exclude = set(self.cfg.exclude_from_loading)
        # checkpoint.config_mismatch = use_new: this run's optimizer settings win over the loaded ones.
        # The containers of titan/training (one optimizer and scheduler per model part).
        optimizer, lr_scheduler = self.states.get("optimizer"), self.states.get("lr_scheduler")
        keep_new = (
            bool(self.start.config_diff)
            and self.cfg.config_mismatch == "use_new"
            and optimizer is not None
            and lr_scheduler is not None
        )
        fresh = hyperparameters(optimizer, lr_scheduler) if keep_new else None
        load_full(path, self.states, self.rank_states, groups=self.groups, dp_rank=self.dp_rank, exclude=exclude)
        if fresh is not None:
            lr = restore_hyperparameters(optimizer, lr_scheduler, fresh)
            logger.info(f"checkpoint.config_mismatch=use_new: lr for the next step is {lr:.3g}")

    def _step(self) -> object:
        """The loaded train state's step, for the log line."""
        return getattr(self.states.get("train_state"), "step", "?")
