"""The Stateful objects of a checkpoint as one flat run of bytes, and back: what an in-memory
snapshot holds (titan/checkpointing/memory_snapshot.py).

``read`` takes each state dict between two steps: those named ``live`` (model and optimizer: only
the optimizer step changes their tensors) as they are, the others deep-copied on the spot (the
next batch already moves the data loader). ``capture`` (in the background) walks them (nested
dicts, lists and tuples) and replaces every tensor by a reference into one byte buffer; what
remains (step counters, learning rates, the data loader's position, Python's RNG) is the
skeleton, pickled. A rank holds its own shards: a DTensor is its local tensor.

``restore`` is DCP's load done from memory: each Stateful's current state dict, its tensors filled
in place from the buffer (into the local shard of a DTensor), the skeleton's other values put
back, then ``load_state_dict``. Two Statefuls are read closer to the metal, since the snapshot is
taken every step and restored into the very same layout (same job): the model parts as their
modules' own state dicts (their parameters and buffers themselves, filled in place), and an
optimizer container as each torch optimizer's own ``state_dict`` / ``load_state_dict`` (its live
state tensors): torch.distributed.checkpoint's FQN-keyed dicts cost tens of milliseconds per call.
The layout digest (every tensor's state, key path, dtype and local shape) tells beforehand whether
a snapshot fits this run's objects (``capture`` of a ``read`` with every state live gives it, and
the sizes, without copying anything).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from titan.checkpointing.snapshot_store import aligned, digest
from titan.checkpointing.states import ModelParts


@dataclass(frozen=True)
class _Ref:
    index: int


@dataclass(frozen=True)
class TensorAt:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class _Access:
    """How a snapshot reads (``get``) and restores (``put``) one Stateful."""

    def __init__(self, stateful: Any) -> None:
        parts = getattr(stateful, "parts", None)
        optimizers = getattr(stateful, "optimizers", None)
        self.get: Callable[[], Any]
        self.put: Callable[[Any], None]
        if isinstance(stateful, ModelParts) and parts is not None:
            self.get = lambda: [part.state_dict(keep_vars=True) for part in parts]
            self.put = lambda state: None  # its tensors are the modules' own, filled in place
        elif isinstance(optimizers, list) and optimizers and all(isinstance(o, Optimizer) for o in optimizers):
            self.get = lambda: [o.state_dict() for o in optimizers]
            self.put = lambda state: _load_each(optimizers, state)
        else:
            self.get, self.put = stateful.state_dict, stateful.load_state_dict


def create_optimizer_state(optimizers: list[Optimizer]) -> None:
    """Give each optimizer without state its state, as a checkpoint load does first (one step with
    zero gradients at learning rate 0: the weights do not move), without torch.distributed.
    checkpoint's FQN-keyed dicts around it."""
    for o in optimizers:
        params = [p for g in o.param_groups for p in g["params"] if p.requires_grad]
        if o.state or any(p.grad is not None for p in params):
            continue
        for p in params:
            p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for g in o.param_groups]
        for g in o.param_groups:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        o.step()
        for g, lr in zip(o.param_groups, lrs):
            g["lr"] = lr
        o.zero_grad(set_to_none=True)


def _load_each(optimizers: list[Optimizer], states: list[Any]) -> None:
    for o, state in zip(optimizers, states):
        o.load_state_dict(state)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _walk(obj: Any, path: str, leaf: Callable[[torch.Tensor, str], Any]) -> Any:
    """``obj`` with every tensor replaced by ``leaf(tensor, key path)``."""
    if isinstance(obj, torch.Tensor):
        return leaf(obj, path)
    if isinstance(obj, dict):
        return {k: _walk(v, f"{path}.{k}", leaf) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_walk(v, f"{path}.{i}", leaf) for i, v in enumerate(obj))
    return obj


@dataclass
class Capture:
    """One snapshot in the making: the sources of its tensors (live ones and clones), where each
    goes in the buffer, and the pickled rest."""

    sources: list[torch.Tensor]
    placed: list[TensorAt]
    meta: bytes
    layout: str
    nbytes: int

    def copy_into(self, buffer: torch.Tensor) -> None:
        for src, at in zip(self.sources, self.placed):
            if at.nbytes:
                view(buffer, at).copy_(src)


def view(buffer: torch.Tensor, at: TensorAt) -> torch.Tensor:
    return buffer[at.offset : at.offset + at.nbytes].view(at.dtype).view(at.shape)


def read(states: Mapping[str, Any], live: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Each Stateful's state now (between steps: FSDP's parameters are their shards): the ``live``
    ones as they are (their tensors copied later), the others deep-copied."""
    return {name: (lambda x: x if name in live else copy.deepcopy(x))(_Access(s).get()) for name, s in states.items()}


def capture(state: Mapping[str, Any]) -> Capture:
    """Where every tensor of ``state`` (``read``'s) goes in the buffer, and the pickled rest."""
    sources: list[torch.Tensor] = []
    placed: list[TensorAt] = []
    keys: list[tuple] = []
    offset = 0

    def add(name: str) -> Callable[[torch.Tensor, str], _Ref]:
        def leaf(t: torch.Tensor, path: str) -> _Ref:
            nonlocal offset
            local = _local(t).detach()
            nbytes = local.numel() * local.element_size()
            placed.append(TensorAt(local.dtype, tuple(local.shape), offset, nbytes))
            keys.append((name, path, str(local.dtype), tuple(local.shape)))
            sources.append(local)
            offset += aligned(nbytes)
            return _Ref(len(sources) - 1)

        return leaf

    skeleton = {name: _walk(value, "", add(name)) for name, value in state.items()}
    layout = digest(repr(keys).encode())
    meta = pickle.dumps({"skeleton": skeleton, "placed": placed, "layout": layout}, protocol=pickle.HIGHEST_PROTOCOL)
    return Capture(sources, placed, meta, layout, offset)


def _fill(saved: Any, current: Any, tensor: Callable[[int], torch.Tensor]) -> Any:
    if isinstance(saved, _Ref):
        if not isinstance(current, torch.Tensor):
            raise ValueError("the snapshot holds a tensor where this run's state has none")
        _local(current).copy_(tensor(saved.index))
        return current
    if isinstance(saved, dict):
        cur = current if isinstance(current, dict) else {}
        return {k: _fill(v, cur.get(k), tensor) for k, v in saved.items()}
    if type(saved) in (list, tuple):
        cur = current if type(current) is type(saved) and len(current) == len(saved) else [None] * len(saved)
        return type(saved)(_fill(v, c, tensor) for v, c in zip(saved, cur))
    return saved


def restore(states: Mapping[str, Any], meta: bytes, buffer: torch.Tensor) -> None:
    """Load a snapshot (its pickled meta and its data buffer) into ``states``."""
    saved = pickle.loads(meta)
    placed: list[TensorAt] = saved["placed"]
    with torch.no_grad():  # parameters are filled in place
        for name, s in states.items():
            access = _Access(s)
            access.put(_fill(saved["skeleton"][name], access.get(), lambda i: view(buffer, placed[i])))
