"""Checkpoints with torch.distributed.checkpoint (DCP): save, async save, resume, seed, export.

One ``CheckpointManager`` per trainer. It saves the model parts, optimizers, LR schedulers, the
data loader of every DP rank, and the train state (step, tokens seen, per-rank RNG) as one DCP
checkpoint in ``<job.dump_folder>/<checkpoint.folder>/step-N`` (keys: titan/checkpointing/states.py;
commit protocol: titan/checkpointing/folders.py). DCP reshards on load, so any FSDP/DDP layout
reads any other's checkpoint; the data loader re-deals its documents when the DP degree changed.

Process groups: DCP and the preemption flag each get their own CPU (gloo) group. An async save
runs DCP's collectives in a background thread; on the trainer's groups they could interleave with
the training collectives of the main thread and deadlock.

Async modes: ``async`` copies the state to host memory before ``save`` returns and writes it in a
thread; ``async_with_pinned_mem`` also does the copy in the background (into reused, pinned buffers
on a GPU machine), so the trainer must wait for that copy before its next optimizer step
(``wait_for_staging``). Either way only one save is in flight: a new save first waits for the last.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
import warnings
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from titan.checkpointing.folders import DebugKill, Found, pick_resume, prune, step_dir, write_marker
from titan.checkpointing.preemption import PreemptionWatcher
from titan.checkpointing.preflight import (
    check_checkpoint_folder,
    check_no_later_checkpoints,
    checkpoint_bytes,
    clear_for_fresh_start,
)
from titan.checkpointing.states import (
    RNG_KEY,
    load_dataloader,
    load_model_state,
    model_state,
    rng_state,
    saved_dp_ranks,
    set_rng_state,
)
from titan.config.validate import CHECKPOINT_PARTS
from titan.errors import TitanError
from titan.parallel.fsdp import DTYPES
from titan.tools.logging import logger

__all__ = ["CheckpointManager"]

# One-process runs pass no_dist=True on purpose; DCP still warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _checkpoint_keys(path: str) -> set[str]:
    try:
        return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except (OSError, ValueError, pickle.UnpicklingError) as e:
        raise TitanError(f"{path} is not a readable DCP checkpoint ({type(e).__name__}: {e})") from None


def _check_shapes(path: str, state: dict[str, Any], prefix: str = "") -> None:
    """Name the first tensor whose saved shape differs (DCP would raise a multi-rank stack trace)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata

    def walk(d: dict[str, Any], pre: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{pre}{k}.")
            elif isinstance(v, torch.Tensor) and f"{pre}{k}" in saved:
                size = getattr(saved[f"{pre}{k}"], "size", None)
                if size is not None and tuple(size) != tuple(v.shape):
                    raise TitanError(
                        f"{path} is a checkpoint of a different model: '{pre}{k}' is {list(size)} there but"
                        f" {list(v.shape)} in this run; use the same model config, another job.dump_folder,"
                        " or --job.overwrite to delete these checkpoints and start fresh")

    walk(state, prefix)


class CheckpointManager:
    """Owns saving and loading for ``trainer`` (its model_parts, optimizers, lr_schedulers,
    dataloader, parallel_dims, dp_rank, step, tokens_seen)."""

    def __init__(self, config: Any, trainer: Any) -> None:
        self.cfg = config.checkpoint
        self.trainer = trainer
        self.total_steps = config.training.steps
        self.root = os.path.join(config.job.dump_folder, self.cfg.folder)
        self.world_size = trainer.parallel_dims.world_size
        if self.cfg.create_seed_checkpoint and self.world_size != 1:
            raise TitanError(f"checkpoint.create_seed_checkpoint needs 1 process without parallelism; this run has "
                             f"{self.world_size} ranks (run it with plain `python train.py`)")
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        self.enabled = self.cfg.enable or self.cfg.create_seed_checkpoint
        distributed = self.enabled and self.world_size > 1
        self.save_pg = dist.new_group(backend="gloo") if distributed else None
        self.ctrl_pg = dist.new_group(backend="gloo") if distributed else None
        self.watcher = PreemptionWatcher(self.ctrl_pg) if self.cfg.enable else None
        self.debug_kill = DebugKill()
        self._pending: tuple[int, str, bool, Future, Future | None, float] | None = None
        self._stager = None
        if self.cfg.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            accel = torch.accelerator.is_available()
            if not accel:
                logger.info("checkpoint.async_mode=async_with_pinned_mem: no accelerator, so staging uses plain "
                            "(unpinned) host memory with blocking copies in a background thread")
            # Non-blocking copies need an accelerator stream (measured: CPU-only torch refuses them).
            self._stager = DefaultStager(StagingOptions(accel, False, True, accel))
        self.last_saved_step = -1
        self.overwrite = config.job.overwrite
        if self.enabled:
            need = checkpoint_bytes(getattr(trainer, "num_params", 0))
            self._agree(lambda: check_checkpoint_folder(self.root, need))

    # ------------------------------------------------------------------ state dicts
    def _full_state(self) -> dict[str, Any]:
        t = self.trainer
        return {
            "model": model_state(t.model_parts),
            "optimizer": t.optimizers.state_dict(),
            "lr_scheduler": t.lr_schedulers.state_dict(),
            "train_state": pickle.dumps({"step": t.step, "tokens_seen": t.tokens_seen}),
            "rng": {RNG_KEY.format(self.rank).split(".", 1)[1]: rng_state()},
            "dataloader": {f"dp_rank_{t.dp_rank}": pickle.dumps(t.dataloader.state_dict())},
        }

    def _dist_kwargs(self) -> dict[str, Any]:
        return {"process_group": self.save_pg} if self.world_size > 1 else {"no_dist": True}

    # ------------------------------------------------------------------ saving
    def _prepare_folder(self, path: str) -> None:
        """Remove an old folder of the same step (torn, or from an abandoned later timeline) before
        any rank writes into it: stale files from another layout must not mix with the new ones."""
        if self.rank == 0 and os.path.exists(path):
            logger.info(f"replacing existing {path}")
            shutil.rmtree(path)
        if self.ctrl_pg is not None:
            dist.barrier(group=self.ctrl_pg)

    def save(self, step: int, *, model_only: bool = False, blocking: bool = False) -> None:
        self.wait()  # one save in flight at a time
        path = step_dir(self.root, step)
        self._prepare_folder(path)
        t0 = time.perf_counter()
        if model_only:
            dtype = DTYPES[self.cfg.export_dtype] if step > 0 else None
            state: dict[str, Any] = model_state(self.trainer.model_parts, dtype)
        else:
            state = self._full_state()
        self.last_saved_step = step
        if self.cfg.async_mode == "disabled" or blocking:
            try:
                dcp.save(state, checkpoint_id=path, **self._dist_kwargs())
            except Exception as e:
                self._save_failed(step, path, e)
            self._commit(step, path, model_only, t0)
            return
        result = dcp.async_save(state, checkpoint_id=path, async_stager=self._stager, **self._dist_kwargs())
        if isinstance(result, AsyncSaveResponse):
            self._pending = (step, path, model_only, result.upload_completion, result.staging_completion, t0)
        else:
            self._pending = (step, path, model_only, result, None, t0)
        logger.info(f"checkpoint step {step}: writing in the background (staged in {time.perf_counter() - t0:.2f} s)")

    def _commit(self, step: int, path: str, model_only: bool, t0: float) -> None:
        # DCP returns (or completes the future) only after the coordinator, rank 0, gathered every
        # rank's write results and wrote .metadata: rank 0's marker is the single commit point.
        self.debug_kill("save", step)
        if self.rank == 0:
            write_marker(path, step, model_only=model_only, world_size=self.world_size,
                         dp_degree=self.trainer.parallel_dims.dp_degree)
            prune(self.root, self.cfg.keep_latest_k)
        kind = "model-only " + self.cfg.export_dtype if model_only else "full"
        logger.info(f"checkpoint step {step} ({kind}) committed to {path} in {time.perf_counter() - t0:.2f} s")

    def wait_for_staging(self) -> None:
        """Block until a background copy of the last async save has finished (before parameters
        or optimizer state change again)."""
        if self._pending is not None and self._pending[4] is not None:
            self._pending[4].result()

    def poll(self) -> None:
        if self._pending is not None and self._pending[3].done():
            self.wait()

    def wait(self) -> None:
        """Finish (and commit) the save in flight, if any."""
        if self._pending is None:
            return
        step, path, model_only, upload, staging, t0 = self._pending
        self._pending = None
        try:
            if staging is not None:
                staging.result()
            upload.result()
        except Exception as e:
            self._save_failed(step, path, e)
        self._commit(step, path, model_only, t0)

    def _save_failed(self, step: int, path: str, error: BaseException) -> None:
        """A failed write (disk full, permissions, ...): drop the torn folder, keep every earlier
        checkpoint (pruning runs only after a commit), stop with one line."""
        inner = next(iter(getattr(error, "failures", {}).values()), error)  # DCP's CheckpointException
        reason = inner.strerror if isinstance(inner, OSError) and inner.strerror else str(inner).splitlines()[0]
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        raise TitanError(f"checkpoint step {step}: writing {path} failed ({reason}); earlier checkpoints in"
                         f" {self.root} are intact: free disk space / fix the folder, then restart to resume") from error

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
            if self.cfg.enable and not preempted and step > 0 and step != self.last_saved_step:
                self.save(step, model_only=self.cfg.last_save_model_only)
            self.wait()
            if self.cfg.enable and self.cfg.last_save_in_hf and not preempted and step > 0:
                self._export_hf(step)
        finally:
            if self.watcher is not None:
                self.watcher.uninstall()
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _export_hf(self, step: int) -> None:
        from titan.interop.hf import save_model_hf

        out = step_dir(self.root, step) + "-hf"
        save_model_hf(self.trainer.model_parts, out, dtype=DTYPES[self.cfg.export_dtype])
        logger.info(f"Hugging Face export of step {step} written to {out}")

    def create_seed_checkpoint(self) -> None:
        self.save(0, model_only=True, blocking=True)
        logger.info(f"seed checkpoint written to {step_dir(self.root, 0)}: start any layout from it with "
                    f"checkpoint.enable (same folder) or checkpoint.initial_load_path")

    # ------------------------------------------------------------------ loading
    def _agree(self, choose: Any) -> Any:
        """Rank 0 decides (it scans the folder), everyone gets its answer or its error."""
        result: list[Any] = [None]
        if self.rank == 0:
            try:
                result[0] = ("ok", choose())
            except TitanError as e:
                result[0] = ("error", str(e))
        if self.ctrl_pg is not None:
            dist.broadcast_object_list(result, src=0, group=self.ctrl_pg)
        status, value = result[0]
        if status == "error":
            error = TitanError(value)
            error.same_on_all_ranks = True  # type: ignore[attr-defined]  # train.py prints it once
            raise error
        return value

    def load(self) -> None:
        """Auto-resume from this run's folder, or start from initial_load_path, or start fresh."""
        if not self.cfg.enable or self.cfg.create_seed_checkpoint:
            return
        found: Found | None = self._agree(lambda: pick_resume(self.root, self.cfg.load_step))
        if found is not None and self.cfg.load_step >= 0:
            self._agree(lambda: check_no_later_checkpoints(found, self.root, self.overwrite))
        elif found is not None and self.overwrite:
            gone = self._agree(lambda: clear_for_fresh_start(self.root))
            logger.warning(f"job.overwrite: deleted the earlier checkpoints {gone}; starting from scratch")
            found = None
        if found is not None:
            if found.model_only:
                logger.info(f"starting from the seed checkpoint {found.path} (model weights only)")
                self._load_model_only(found.path)
            else:
                self._load_full(found.path, set(self.cfg.exclude_from_loading))
                logger.info(f"resumed from {found.path}: step {self.trainer.step}")
            self.last_saved_step = found.step
            return
        path = self.cfg.initial_load_path
        if not path:
            logger.info(f"no checkpoint in {self.root}: starting from scratch")
            return
        if self.cfg.initial_load_in_hf:
            from titan.interop.hf import load_hf_into_model

            load_hf_into_model(self.trainer.model_parts, path)
            logger.info(f"loaded Hugging Face weights from checkpoint.initial_load_path {path}")
            return
        self._agree(lambda: os.path.isfile(os.path.join(path, ".metadata")) or _raise_missing(path))
        if self.cfg.initial_load_model_only:
            self._load_model_only(path)
            logger.info(f"loaded model weights from checkpoint.initial_load_path {path}")
        else:
            self._load_full(path, set(self.cfg.exclude_from_loading))
            logger.info(f"loaded checkpoint.initial_load_path {path}: step {self.trainer.step}")

    def _load_model_only(self, path: str) -> None:
        keys = _checkpoint_keys(path)
        state = model_state(self.trainer.model_parts)
        nested = any(k.startswith("model.") for k in keys)  # a full checkpoint nests the model
        self._agree(lambda: _check_shapes(path, state, "model." if nested else ""))
        dcp.load({"model": state} if nested else state, checkpoint_id=path, **self._dist_kwargs())
        load_model_state(self.trainer.model_parts, state)

    def _load_full(self, path: str, exclude: set[str]) -> None:
        t = self.trainer
        keys = _checkpoint_keys(path)
        parts = [p for p in CHECKPOINT_PARTS if p not in exclude]
        state: dict[str, Any] = {}
        if "model" in parts:
            state["model"] = model_state(t.model_parts)
        if "optimizer" in parts:
            state["optimizer"] = t.optimizers.state_dict()
        if "lr_scheduler" in parts:
            state["lr_scheduler"] = t.lr_schedulers.state_dict()
        rng_key = None
        if "train_state" in parts:
            if "train_state" not in keys:
                raise TitanError(f"{path} holds no train state (a model-only checkpoint?): load it with "
                                 "checkpoint.initial_load_path and initial_load_model_only")
            state["train_state"] = b""
            mine, first = RNG_KEY.format(self.rank), RNG_KEY.format(0)
            rng_key = mine if mine in keys else first if first in keys else None
            if rng_key is not None:
                state["rng"] = {rng_key.split(".", 1)[1]: b""}
        dp_ranks = saved_dp_ranks(keys) if "dataloader" in parts else []
        dp_degree = t.parallel_dims.dp_degree
        if dp_ranks:
            wanted = [t.dp_rank] if len(dp_ranks) == dp_degree else dp_ranks
            state["dataloader"] = {f"dp_rank_{r}": b"" for r in wanted}
        self._agree(lambda: _check_shapes(path, {"model": state["model"]} if "model" in state else {}))
        dcp.load(state, checkpoint_id=path, **self._dist_kwargs())
        if "model" in state:
            load_model_state(t.model_parts, state["model"])
        if "optimizer" in state:
            t.optimizers.load_state_dict(state["optimizer"])
        if "lr_scheduler" in state:
            t.lr_schedulers.load_state_dict(state["lr_scheduler"])
        if "train_state" in state:
            train_state = pickle.loads(state["train_state"])
            t.step, t.tokens_seen = train_state["step"], train_state["tokens_seen"]
            if rng_key is not None:
                set_rng_state(next(iter(state["rng"].values())))
        if "dataloader" in state:
            blobs = {int(k.rsplit("_", 1)[1]): v for k, v in state["dataloader"].items()}
            load_dataloader(t.dataloader, blobs, t.dp_rank, len(dp_ranks), dp_degree)
        elif "dataloader" in parts:
            logger.warning(f"{path} holds no data loader state: the data starts from its beginning")


def _raise_missing(path: str) -> bool:
    raise TitanError(f"checkpoint.initial_load_path {path!r} is not a DCP checkpoint folder (no .metadata in it)")
