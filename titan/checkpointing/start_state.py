"""What a starting run loads, newest first: this run's in-memory snapshots or its newest intact
checkpoint folder (auto-resume), a chosen ``checkpoint.load_step``, else ``initial_load_path``,
else nothing. Called by the checkpoint manager's ``load`` (titan/checkpointing/manager.py), whose
states it fills; the folder itself and the config were settled by resume.prepare_run."""

from __future__ import annotations

import os
from typing import Any

from titan.checkpointing.loading import (
    hyperparameters,
    load_full,
    load_model_only,
    raise_missing,
    restore_hyperparameters,
)
from titan.checkpointing.preflight import check_no_later_checkpoints, clear_for_fresh_start
from titan.log import logger


def start_state(self: Any) -> None:
    """What a starting run loads into ``self`` (a CheckpointManager), in its order of preference."""
    cfg, agree = self.cfg, self.groups.agree
    if not cfg.enable or cfg.create_seed_checkpoint:
        return
    found = self.start.found
    if self.snapshots is not None:  # the newest of memory and disk (a chosen step or a fresh start: disk)
        disk = found.step if found is not None else -1
        if self.snapshots.start(disk, usable=cfg.load_step < 0 and not self.overwrite) is not None:
            self.last_saved_step, self.resumed = disk, True
            return
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
            _load_full(self, found.path)
            logger.info(f"resumed from {found.path}: step {_step(self)}")
        self.last_saved_step, self.resumed = found.step, True
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
        _load_full(self, path)
        logger.info(f"loaded checkpoint.initial_load_path {path}: step {_step(self)}")


def _load_full(self: Any, path: str) -> None:
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


def _step(self: Any) -> object:
    """The loaded train state's step, for the log line."""
    return getattr(self.states.get("train_state"), "step", "?")
