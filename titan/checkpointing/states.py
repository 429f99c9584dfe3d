"""What goes into a checkpoint, as a DCP state dict, and how it comes back out.

The trainer hands the manager Stateful objects (``state_dict`` / ``load_state_dict``): the model
parts as one ``ModelParts``, the optimizer and LR scheduler containers, the data loader and a
``TrainState``. The manager lays their state dicts out under these keys (DCP flattens nested
dicts with "."):

- ``model.<fqn>``: the model parts' parameters and buffers (DTensors under FSDP/TP; DCP reshards).
  A model-only checkpoint (seed, final export) stores them at the top level, ``<fqn>``, so plain
  ``dcp.load(fresh_model.state_dict(), checkpoint_id=...)`` reads it.
- ``optimizer.*`` (FQN-keyed, see titan/training/optim.py), ``lr_scheduler.*``: identical on every rank.
- ``train_state``: pickled ``TrainState.state_dict()`` {step, tokens_seen}, identical on every rank.
- ``rng.rank_<r>``, ``dataloader.dp_rank_<d>``: pickled bytes that differ per rank. DCP keeps only
  one copy of a non-tensor key however many ranks save it, so per-rank values need distinct keys.
"""

from __future__ import annotations

import pickle
import random
import re
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

from titan.log import logger

_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


def dcp_call(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A ``dcp.save``/``async_save``/``load`` call. Without a process group DCP warns that it
    assumes one process, which is what titan means there: the warning is silenced for this call
    only (the upload thread of a one-process async save may still print it once)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        return call(*args, **kwargs)


DP_KEY = re.compile(r"^dataloader\.dp_rank_(\d+)$")
RNG_KEY = "rng.rank_{}"


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


def rng_state() -> bytes:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(state)


def set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning("checkpoint CUDA RNG states are for another GPU count; CUDA RNG not restored")


def saved_dp_ranks(keys: set[str]) -> list[int]:
    return sorted(int(m[1]) for k in keys if (m := DP_KEY.match(k)))


def load_dataloader(dataloader: Any, blobs: dict[int, bytes], dp_rank: int, old: int, dp_degree: int) -> None:
    """Restore this DP rank's loader from ``blobs`` (dp rank -> state); when the DP degree changed
    (``old`` != ``dp_degree``) ``blobs`` holds all old ranks' states and they go to
    ``load_resharded`` (the loader re-deals unread documents, none repeated or skipped)."""
    if old == dp_degree:
        dataloader.load_state_dict(pickle.loads(blobs[dp_rank]))
        return
    logger.info(f"checkpoint data loader states are from {old} dp ranks, this run has {dp_degree}: resharding")
    dataloader.load_resharded([pickle.loads(blobs[r]) for r in sorted(blobs)])
