"""Checkpoints with torch.distributed.checkpoint (DCP): save, async save, resume, seed, export.

One ``CheckpointManager`` per trainer. The trainer hands it Stateful objects (model parts,
optimizers, LR schedulers, data loader, train state: states.py) and the facts of its layout (world
size, rank, DP rank and degree); it never reads the trainer. It saves those states (the data
loader's of every DP rank) and each rank's RNG as one DCP checkpoint in
``<job.dump_folder>/<checkpoint.folder>/step-N`` (keys: states.py; commit protocol: folders.py). DCP reshards on load, so any FSDP/DDP layout reads any other's checkpoint.

A save is committed in this order: rank 0 writes ``config.json`` (config_diff.py) into the empty
folder, DCP writes every rank's files and ``.metadata``, rank 0 hashes every file into
``MANIFEST.json`` (manifest.py), then writes ``COMPLETE``. A failed save (any rank, any
exception, DCP's BaseException-derived CheckpointException included) is explained in one line
(failure.py), its partial folder removed, and the run stops or, with ``on_save_error = "retry"``,
goes on to the next interval.

Process groups: DCP and the preemption flag each get their own CPU (gloo) group. An async save
runs DCP's collectives in a background thread; on the trainer's groups they could interleave with
the training collectives of the main thread and deadlock.

Async modes: ``async`` copies the state to host memory before ``save`` returns and writes it in a
thread; ``async_with_pinned_mem`` also does the copy in the background (into reused, pinned buffers
on a GPU machine: staging.py), so the trainer must wait for that copy before its next optimizer
step (``wait_for_staging``). Either way only one save is in flight: a new save first waits for the
last, so the reused buffers are never overwritten while still being written out.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from titan.checkpointing import config_diff
from titan.checkpointing.failure import explain
from titan.checkpointing.folders import DebugKill, delete, prune, scan, step_dir, write_marker
from titan.checkpointing.loading import Loading
from titan.checkpointing.manifest import write_manifest
from titan.checkpointing.preemption import PreemptionWatcher
from titan.checkpointing.preflight import check_checkpoint_folder, checkpoint_bytes
from titan.checkpointing.resume import RunStart, agree, choose_intact
from titan.checkpointing.states import RNG_KEY, ModelParts, TrainState, dcp_call, rng_state
from titan.errors import TitanError
from titan.parallel.fsdp import DTYPES
from titan.log import logger

__all__ = ["CheckpointManager"]


@dataclass
class _Pending:
    step: int
    path: str
    model_only: bool
    done: Future  # the upload, then (rank 0) the manifest
    staging: Future | None
    t0: float


class CheckpointManager(Loading):
    """Saves and loads the Stateful objects it is handed. ``config`` is the whole job config (its
    checkpoint section, training.steps, job.dump_folder and job.overwrite drive the manager; all of
    it is recorded in each checkpoint). ``world_size``, ``rank``, ``dp_rank`` and ``dp_degree`` name
    the per-rank keys and the layout a checkpoint was written with; ``num_params`` sizes the disk
    preflight. ``start`` is what resume.prepare_run settled; without it (tests, tools) the
    checkpoint to resume from is chosen here."""

    def __init__(self, config: Any, *, model: ModelParts, optimizer: Stateful, lr_scheduler: Stateful,
                 dataloader: Stateful, train_state: TrainState, world_size: int, rank: int, dp_rank: int,
                 dp_degree: int, num_params: int, start: RunStart | None = None) -> None:
        self.config = config
        self.cfg = config.checkpoint
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dataloader, self.train_state = dataloader, train_state
        self.total_steps = config.training.steps
        self.root = os.path.join(config.job.dump_folder, self.cfg.folder)
        self.world_size = world_size
        if self.cfg.create_seed_checkpoint and self.world_size != 1:
            raise TitanError(f"checkpoint.create_seed_checkpoint needs 1 process without parallelism; this run has "
                             f"{self.world_size} ranks (run it with plain `python train.py`)")
        self.rank, self.dp_rank, self.dp_degree = rank, dp_rank, dp_degree
        self.enabled = self.cfg.enable or self.cfg.create_seed_checkpoint
        distributed = self.enabled and self.world_size > 1
        self.save_pg = dist.new_group(backend="gloo") if distributed else None
        self.ctrl_pg = dist.new_group(backend="gloo") if distributed else None
        self.watcher = PreemptionWatcher(self.ctrl_pg) if self.cfg.enable else None
        self.debug_kill = DebugKill()
        self._pending: _Pending | None = None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-ckpt-commit")
        self._stager = None
        if self.cfg.async_mode == "async_with_pinned_mem":
            from titan.checkpointing.staging import OwnedStager

            self._stager = OwnedStager()
        self.last_saved_step = -1
        self.overwrite = config.job.overwrite
        if self.enabled:
            need = checkpoint_bytes(num_params)
            self._agree(lambda: check_checkpoint_folder(self.root, need))
        if start is None:
            resuming = self.cfg.enable and (self.cfg.load_step >= 0 or not self.overwrite)
            start = RunStart(found=self._agree(lambda: choose_intact(self.root, self.cfg.load_step))
                             if resuming else None)
        self.start = start

    # ------------------------------------------------------------------ state dicts
    def _full_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": pickle.dumps(self.train_state.state_dict()),
            "rng": {RNG_KEY.format(self.rank).split(".", 1)[1]: rng_state()},
            "dataloader": {f"dp_rank_{self.dp_rank}": pickle.dumps(self.dataloader.state_dict())},
        }

    def _dcp(self, call: Callable[..., Any], state: dict[str, Any], path: str, **kwargs: Any) -> Any:
        """``dcp.save``/``async_save``/``load`` on the checkpoint group, or with no_dist in a
        one-process run."""
        dist_kwargs = {"process_group": self.save_pg} if self.world_size > 1 else {"no_dist": True}
        return dcp_call(call, state, checkpoint_id=path, **dist_kwargs, **kwargs)

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
                tree = config_diff.snapshot(self.config, self.dp_degree)
                config_diff.write_config(path, tree)
            except OSError as e:  # every rank raises it, so all take the same failure path
                return e.errno, e.strerror
            return None

        failed = self._agree(prepare)
        if failed is not None:
            raise OSError(*failed)

    def save(self, step: int, *, model_only: bool = False, blocking: bool = False, final: bool = False) -> None:
        self.wait()  # one save in flight at a time
        path = step_dir(self.root, step)
        t0 = time.perf_counter()
        try:
            self._prepare_folder(path)
            if model_only:
                dtype = DTYPES[self.cfg.export_dtype] if step > 0 else None
                state: dict[str, Any] = self.model.state_dict(dtype)
            else:
                state = self._full_state()
            if self.cfg.async_mode == "disabled" or blocking:
                self._dcp(dcp.save, state, path)
                if self.rank == 0:
                    write_manifest(path)
                self._commit(step, path, model_only, t0)
                return
            result = self._dcp(dcp.async_save, state, path, async_stager=self._stager)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            self._save_failed(step, path, e, final or blocking)
            return
        upload, staging = (result.upload_completion, result.staging_completion) \
            if isinstance(result, AsyncSaveResponse) else (result, None)
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
        self.debug_kill("save", step)
        if self.rank == 0:
            write_marker(path, step, model_only=model_only, world_size=self.world_size,
                         dp_degree=self.dp_degree)
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
        kept = f"earlier checkpoints in {self.root} are intact (newest: {newest})" if newest else \
            f"no earlier checkpoint in {self.root}"
        message = f"checkpoint step {step}: writing {path} failed: {cause}; the partial folder was removed, {kept}"
        retry_at = min((step // self.cfg.interval + 1) * self.cfg.interval, self.total_steps)
        if self.cfg.on_save_error == "retry" and not final:
            logger.warning(f"{message}; {advice}. checkpoint.on_save_error=retry: training goes on, next save at"
                           f" step {retry_at}")
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
        self.debug_kill("step", step)
        if not self.cfg.enable:
            return False
        self.poll()
        stop = self.watcher.should_stop() if self.watcher is not None else False
        if stop:
            self.save(step, blocking=True)
            logger.warning(f"checkpoint step {step} saved after a signal; stopping (exit 0)")
        elif step % self.cfg.interval == 0 and step < self.total_steps:
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
        """The final save as a Hugging Face folder at step-N (the path torchtitan's
        initial_load_in_hf users load back), committed like a DCP save: manifest, then marker."""
        from titan.checkpointing.hf import save_model_hf

        out = step_dir(self.root, step)
        t0 = time.perf_counter()

        def prepare() -> None:
            if os.path.exists(out):
                logger.info(f"replacing existing {out}")
                delete(out, ignore_errors=False)

        self._agree(prepare)
        save_model_hf(self.model.parts, out, dtype=DTYPES[self.cfg.export_dtype])
        if self.rank == 0:
            write_manifest(out)
            write_marker(out, step, model_only=True, world_size=self.world_size, dp_degree=self.dp_degree, fmt="hf")
            prune(self.root, self.cfg.keep_latest_k)
        self.last_saved_step = step
        logger.info(f"Hugging Face export of step {step} ({self.cfg.export_dtype}) written to {out} in"
                    f" {time.perf_counter() - t0:.2f} s")

    def create_seed_checkpoint(self) -> None:
        self.save(0, model_only=True, blocking=True, final=True)
        logger.info(f"seed checkpoint written to {step_dir(self.root, 0)}: start any layout from it with "
                    f"checkpoint.enable (same folder) or checkpoint.initial_load_path")
        self.start.release()

    def _agree(self, choose: Any) -> Any:
        return agree(choose, self.rank, self.ctrl_pg)
