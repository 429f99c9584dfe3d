"""Loading a checkpoint into the manager's states: auto-resume, load_step, initial_load_path, seed.

Which checkpoint (newest intact, verified against its manifest) and whether its config may be
used were settled before the trainer was built (titan/checkpointing/resume.py); this module reads
it into the Stateful objects the trainer handed the manager: the built model, optimizers,
schedulers, data loader and train state.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from titan.checkpointing.failure import explain
from titan.checkpointing.folders import Found
from titan.checkpointing.preflight import check_no_later_checkpoints, clear_for_fresh_start
from titan.checkpointing.states import RNG_KEY, load_dataloader, saved_dp_ranks, set_rng_state
from titan.config.choices import CHECKPOINT_PARTS
from titan.errors import TitanError
from titan.log import logger


def checkpoint_keys(path: str) -> set[str]:
    try:
        return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise TitanError(f"{path} is not a readable DCP checkpoint ({type(e).__name__}: {e}); pick another with"
                         " --checkpoint.load_step N") from None


def check_shapes(path: str, state: dict[str, Any], prefix: str = "") -> None:
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


def _hyperparameters(optimizers: Any, lr_schedulers: Any) -> tuple[list[list[dict]], list[list[float]]]:
    """This run's optimizer param-group settings and scheduler base lrs (from its config), read
    from the optimizer container (one optimizer per model part) and the scheduler container."""
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers]
    return groups, [list(s.base_lrs) for s in lr_schedulers.schedulers]


def _restore_hyperparameters(optimizers: Any, lr_schedulers: Any,
                             saved: tuple[list[list[dict]], list[list[float]]]) -> None:
    """checkpoint.config_mismatch = use_new: the loaded optimizer/scheduler state carries the old
    run's lr, betas, ...; put this run's back and recompute the lr of the current step."""
    groups, base_lrs = saved
    for opt, sched, opt_groups, bases in zip(optimizers, lr_schedulers.schedulers, groups, base_lrs):
        sched.base_lrs = list(bases)
        for group, fresh, base, fn in zip(opt.param_groups, opt_groups, bases, sched.lr_lambdas):
            group.update(fresh)
            group["initial_lr"] = base
            group["lr"] = base * fn(sched.last_epoch)
        sched._last_lr = [g["lr"] for g in opt.param_groups]


class Loading:
    """Loading half of CheckpointManager (needs cfg, the states, root, rank, dp_rank, dp_degree,
    overwrite, start, _agree, _dcp)."""

    def load(self) -> None:
        """Auto-resume from this run's folder, or start from initial_load_path, or start fresh."""
        if not self.cfg.enable or self.cfg.create_seed_checkpoint:
            return
        found: Found | None = self.start.found
        if found is not None and self.cfg.load_step >= 0:
            self._agree(lambda: check_no_later_checkpoints(found, self.root, self.overwrite))
        elif self.overwrite and self.cfg.load_step < 0:
            gone = self._agree(lambda: clear_for_fresh_start(self.root))
            if gone:
                logger.warning(f"job.overwrite: deleted the earlier checkpoints {gone}; starting from scratch")
        if found is not None:
            if found.model_only:
                logger.info(f"starting from the seed checkpoint {found.path} (model weights only)")
                self._load_model_only(found.path)
            else:
                self._load_full(found.path, set(self.cfg.exclude_from_loading))
                logger.info(f"resumed from {found.path}: step {self.train_state.step}")
            self.last_saved_step = found.step
            return
        path = self.cfg.initial_load_path
        if not path:
            logger.info(f"no checkpoint in {self.root}: starting from scratch")
            return
        if self.cfg.initial_load_in_hf:
            from titan.checkpointing.hf import load_hf_into_model

            load_hf_into_model(self.model.parts, path)
            logger.info(f"loaded Hugging Face weights from checkpoint.initial_load_path {path}")
            return
        self._agree(lambda: os.path.isfile(os.path.join(path, ".metadata")) or _raise_missing(path))
        if self.cfg.initial_load_model_only:
            self._load_model_only(path)
            logger.info(f"loaded model weights from checkpoint.initial_load_path {path}")
        else:
            self._load_full(path, set(self.cfg.exclude_from_loading))
            logger.info(f"loaded checkpoint.initial_load_path {path}: step {self.train_state.step}")

    def _dcp_load(self, state: dict[str, Any], path: str) -> None:
        try:
            self._dcp(dcp.load, state, path)
        except (Exception, CheckpointException) as e:
            cause, _ = explain(e, path)
            raise TitanError(f"reading {path} failed ({cause}); load another checkpoint with --checkpoint.load_step N"
                             " (add --job.overwrite true if later ones exist)") from e

    def _load_model_only(self, path: str) -> None:
        keys = self._agree(lambda: checkpoint_keys(path))
        state = self.model.state_dict()
        nested = any(k.startswith("model.") for k in keys)  # a full checkpoint nests the model
        self._agree(lambda: check_shapes(path, state, "model." if nested else ""))
        self._dcp_load({"model": state} if nested else state, path)
        self.model.load_state_dict(state)

    def _load_full(self, path: str, exclude: set[str]) -> None:
        keys = self._agree(lambda: checkpoint_keys(path))
        parts = [p for p in CHECKPOINT_PARTS if p not in exclude]
        # DCP loads in place into these dicts; each Stateful then takes its own back.
        by_name = {"model": self.model, "optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler}
        state: dict[str, Any] = {name: by_name[name].state_dict() for name in by_name if name in parts}
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
        if dp_ranks:
            wanted = [self.dp_rank] if len(dp_ranks) == self.dp_degree else dp_ranks
            state["dataloader"] = {f"dp_rank_{r}": b"" for r in wanted}
        self._agree(lambda: check_shapes(path, {"model": state["model"]} if "model" in state else {}))
        fresh = _hyperparameters(self.optimizer, self.lr_scheduler)
        self._dcp_load(state, path)
        for name, stateful in by_name.items():
            if name in state:
                stateful.load_state_dict(state[name])
        if self.start.config_diff and self.cfg.config_mismatch == "use_new":
            _restore_hyperparameters(self.optimizer, self.lr_scheduler, fresh)
            logger.info("checkpoint.config_mismatch=use_new: lr for the next step is"
                        f" {self.lr_scheduler.get_last_lr():.3g}")
        if "train_state" in state:
            self.train_state.load_state_dict(pickle.loads(state["train_state"]))
            if rng_key is not None:
                set_rng_state(next(iter(state["rng"].values())))
        if "dataloader" in state:
            blobs = {int(k.rsplit("_", 1)[1]): v for k, v in state["dataloader"].items()}
            load_dataloader(self.dataloader, blobs, self.dp_rank, len(dp_ranks), self.dp_degree)
        elif "dataloader" in parts:
            logger.warning(f"{path} holds no data loader state: the data starts from its beginning")


def _raise_missing(path: str) -> bool:
    from titan.checkpointing.hf import INDEX_FILE

    if os.path.isfile(os.path.join(path, INDEX_FILE)):
        raise TitanError(f"checkpoint.initial_load_path {path!r} is not a DCP checkpoint folder but a Hugging Face"
                         " folder: add --checkpoint.initial_load_in_hf")
    raise TitanError(f"checkpoint.initial_load_path {path!r} is not a DCP checkpoint folder (no .metadata in it)")
