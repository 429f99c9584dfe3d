"""Loading a checkpoint into the manager's states: auto-resume, load_step, initial_load_path, seed.

Which checkpoint (newest intact, verified against its manifest) and whether its config may be
used were settled before the trainer was built (titan/checkpointing/resume.py); these functions
read it into the Stateful objects the trainer handed the manager, each by its name: the DCP states
(model, optimizer, ...) and the per-rank ones (rank_states.py). Nothing here knows a state by name.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader

from titan.checkpointing.failure import explain
from titan.checkpointing.groups import CheckpointGroups
from titan.checkpointing.rank_states import RankFiles, SavedRankStates, legacy_request, legacy_saved
from titan.checkpointing.states import ModelParts
from titan.errors import TitanError
from titan.log import logger


def checkpoint_keys(path: str) -> set[str]:
    try:
        return set(FileSystemReader(path).read_metadata().state_dict_metadata)
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise TitanError(
            f"{path} is not a readable DCP checkpoint ({type(e).__name__}: {e}); pick another with"
            " --checkpoint.load_step N"
        ) from None


def check_shapes(path: str, state: dict[str, Any], prefix: str = "") -> None:
    """Name the first tensor whose saved shape differs (DCP would raise a multi-rank stack trace)."""
    saved = FileSystemReader(path).read_metadata().state_dict_metadata

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
                        " or --job.overwrite to delete these checkpoints and start fresh"
                    )

    walk(state, prefix)


def hyperparameters(optimizers: Any, lr_schedulers: Any) -> tuple[list[list[dict]], list[list[float]]]:
    """This run's optimizer param-group settings and scheduler base lrs (from its config), read
    from the optimizer container (one optimizer per model part) and the scheduler container."""
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers]
    return groups, [list(s.base_lrs) for s in lr_schedulers.schedulers]


def restore_hyperparameters(
    optimizers: Any, lr_schedulers: Any, saved: tuple[list[list[dict]], list[list[float]]]
) -> float:
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
    return lr_schedulers.get_last_lr()


def dcp_load(groups: CheckpointGroups, state: dict[str, Any], path: str) -> None:
    try:
        groups.dcp(state_dict_loader.load, state, path)
    except (Exception, CheckpointException) as e:
        cause, _ = explain(e, path)
        raise TitanError(
            f"reading {path} failed ({cause}); load another checkpoint with --checkpoint.load_step N"
            " (add --job.overwrite true if later ones exist)"
        ) from e


def load_model_only(path: str, model: ModelParts, groups: CheckpointGroups) -> None:
    """The model weights of a model-only folder (seed, export) or of a full checkpoint."""
    keys = groups.agree(lambda: checkpoint_keys(path))
    state = model.state_dict()
    nested = any(k.startswith("model.") for k in keys)  # a full checkpoint nests the model
    groups.agree(lambda: check_shapes(path, state, "model." if nested else ""))
    dcp_load(groups, {"model": state} if nested else state, path)
    model.load_state_dict(state)


def load_full(
    path: str,
    states: Mapping[str, Any],
    rank_states: Mapping[str, Any],
    *,
    groups: CheckpointGroups,
    dp_rank: int,
    exclude: Collection[str] = (),
) -> None:
    """Every state and per-rank state not in ``exclude`` from the checkpoint at ``path``."""
    keys = groups.agree(lambda: checkpoint_keys(path))
    wanted = {name: s for name, s in states.items() if name not in exclude}
    # DCP loads in place into these dicts; each Stateful then takes its own back.
    request: dict[str, Any] = {}
    for name, stateful in wanted.items():
        if name in keys:  # written before per-rank files: one pickled blob under the state's name
            request[name] = b""
        elif any(k.startswith(f"{name}.") for k in keys):
            request[name] = stateful.state_dict()
        else:
            raise TitanError(
                f"{path} holds no {name} state (a model-only checkpoint?): load it with"
                " checkpoint.initial_load_path and initial_load_model_only, or add it to"
                " checkpoint.exclude_from_loading"
            )
    per_rank = {name: s for name, s in rank_states.items() if name not in exclude}
    files = RankFiles(path)
    legacy = {} if files.ranks else legacy_request(keys, per_rank)
    request.update(legacy)
    groups.agree(lambda: check_shapes(path, request))
    dcp_load(groups, request, path)
    for name, stateful in wanted.items():
        value = request[name]
        stateful.load_state_dict(pickle.loads(value) if isinstance(value, bytes) else value)
    saved = legacy_saved({name: request[name] for name in legacy}, groups.rank, dp_rank) if legacy else {}
    for name, stateful in per_rank.items():
        load_rank_state(path, name, stateful, saved.get(name) or files.saved(name, groups.rank))


def load_rank_state(path: str, name: str, stateful: Any, saved: SavedRankStates) -> None:
    """A per-rank Stateful decides for itself how to take the saved ranks' states
    (``load_rank_states``), or takes its own rank's (``load_state_dict``)."""
    if not saved:
        logger.warning(f"{path} holds no {name} state: this run's {name} starts from its beginning")
        return
    load = getattr(stateful, "load_rank_states", None)
    if load is not None:
        load(saved)
        return
    mine = saved.mine()
    if mine is None:
        raise TitanError(
            f"{path} holds no {name} state for this rank (the run that saved it had fewer ranks);"
            f" add {name} to checkpoint.exclude_from_loading to start it afresh"
        )
    stateful.load_state_dict(mine)


def raise_missing(path: str) -> bool:
    from titan.checkpointing.hf import INDEX_FILE

    if os.path.isfile(os.path.join(path, INDEX_FILE)):
        raise TitanError(
            f"checkpoint.initial_load_path {path!r} is not a DCP checkpoint folder but a Hugging Face"
            " folder: add --checkpoint.initial_load_in_hf"
        )
    raise TitanError(f"checkpoint.initial_load_path {path!r} is not a DCP checkpoint folder (no .metadata in it)")
