"""The Stateful objects a checkpoint is made of, and the DCP call they go through.

The trainer hands the manager two dicts of Stateful objects (``state_dict`` / ``load_state_dict``):

- ``states``, saved through DCP under their names (DCP flattens nested dicts with "."):
  ``model.<fqn>`` (the model parts as one ``ModelParts``: DTensors under FSDP/TP, which DCP
  reshards), ``optimizer.*`` (FQN-keyed, see titan/training/optim.py), ``lr_scheduler.*`` and
  ``train_state.*`` (a ``TrainState``), identical on every rank. A model-only checkpoint (seed,
  final export) stores the weights at the top level, ``<fqn>``, so plain
  ``dcp.load(fresh_model.state_dict(), checkpoint_id=...)`` reads it.
- ``rank_states``, which differ per rank (this process's ``RNGState``, the data loader's
  position): written per rank beside the DCP files (rank_states.py).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan.checkpointing.rank_states import SavedRankStates
from titan.log import logger

_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def dcp_call(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A ``dcp.save``/``async_save``/``load`` call. Without a process group DCP warns that it
    assumes one process, which is what titan means there: the warning is silenced for this call
    only (the upload thread of a one-process async save may still print it once)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        return call(*args, **kwargs)


class ModelParts(Stateful):
    """The model parts (one, or one per pipeline stage on this rank) as one Stateful: parts own
    disjoint FQNs, so their state dicts merge into one and split back by key."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = list(parts)

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """All parts' weights in one FQN dict; cast to ``dtype`` if given (model-only exports)."""
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        if dtype is not None:
            merged = {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in merged.items()}
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each part takes its own keys; together the parts must use every key."""
        used = set()
        for part in self.parts:
            own = {k: state_dict[k] for k in get_model_state_dict(part) if k in state_dict}
            used.update(own)
            set_model_state_dict(part, own, options=StateDictOptions(strict=True))
        missing = set(state_dict) - used
        if missing:
            raise RuntimeError(f"checkpoint model keys used by no model part: {sorted(missing)[:5]}")


@dataclass
class TrainState(Stateful):
    """Where training stands: optimizer steps done and tokens consumed (all DP ranks together).
    The trainer owns and advances it; a checkpoint saves and restores it."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state_dict["step"]), int(state_dict["tokens_seen"])


class RNGState(Stateful):
    """This process's random number generators (Python's, torch's CPU and, on a GPU machine, CUDA's),
    saved and restored per rank."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            if len(state_dict["cuda"]) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(state_dict["cuda"])
            else:
                logger.warning("checkpoint CUDA RNG states are for another GPU count; CUDA RNG not restored")

    def load_rank_states(self, saved: SavedRankStates) -> None:
        """This rank's saved generators; a rank the saving run did not have takes rank 0's."""
        mine = saved.mine()
        if mine is None:
            mine = next(iter(saved.all()), None)
        if mine is not None:
            self.load_state_dict(mine)
