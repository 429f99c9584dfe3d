"""Where a rank's storages get their categories: hooks on the built model and optimizers.

``attach`` tells the memory tracker (titan/tools/simulate/memory.py) what the rank's objects are
and marks the regions of a step: FSDP's all-gathers and reduce-scatters (communication; the sharded
gradient FSDP hands over after its reduce-scatter: gradients), the output projection and the loss
until the gradient reaches the projection's input (loss), gradient clipping and the optimizer step
(optimizer_aux; what the optimizer keeps as its state: optimizer_state) and the step's phases.
It works on any rank object with the Trainer's attributes (model_parts, optimizers), fake or real.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan.tools.simulate.memory import MemoryTracker
from titan.training.loss import output_module

__all__ = ["attach", "optimizer_states"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def optimizer_states(optimizers: Any) -> Iterator[torch.Tensor]:
    """Every tensor the optimizers keep between steps (moments, momentum, step counters)."""
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


def _in_region(tracker: MemoryTracker, category: str, fn: Callable, after: Callable[[], None] | None = None):
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with tracker.region(category):
            out = fn(*args, **kwargs)
        if after is not None:
            after()
        return out

    return wrapped


def _fsdp_groups(parts: list[nn.Module]) -> Iterator[Any]:
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    yield group


def _attach_fsdp(tracker: MemoryTracker, parts: list[nn.Module]) -> None:
    """Gathered parameters and reduce-scatter buffers are communication; the sharded gradients
    each reduce-scatter leaves are gradients."""
    for group in _fsdp_groups(parts):

        def grads(group: Any = group) -> None:
            tracker.tag((p.sharded_param.grad for p in group.fsdp_params), "gradients")

        group.unshard = _in_region(tracker, "communication", group.unshard)
        group.wait_for_unshard = _in_region(tracker, "communication", group.wait_for_unshard)
        group.post_backward = _in_region(tracker, "communication", group.post_backward, grads)


def _attach_loss(tracker: MemoryTracker, parts: list[nn.Module]) -> None:
    """From the output projection's forward until the gradient reaches its input: the loss's."""
    output = output_module(parts)
    if output is None:
        return

    def end(grad: torch.Tensor) -> None:
        tracker.loss_tail = False

    def start(module: nn.Module, args: tuple) -> None:
        tracker.loss_tail = True
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(end)

    output.register_forward_pre_hook(start)


def attach(tracker: MemoryTracker, rank: Any) -> None:
    """Tag what the rank holds now (parameters, buffers, optimizer state) and hook the step's regions."""
    parts: list[nn.Module] = rank.model_parts
    tracker.tag((_local(p) for part in parts for p in part.parameters()), "parameters")
    tracker.tag((_local(b) for part in parts for b in part.buffers()), "parameters")
    tracker.tag(optimizer_states(rank.optimizers), "optimizer_state")
    _attach_fsdp(tracker, parts)
    _attach_loss(tracker, parts)
    # Gradients autograd accumulates itself (parameters outside FSDP: DDP, TP-only, one rank).
    for part in parts:
        for p in part.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p: tracker.tag([p.grad], "gradients"))
    optimizers = rank.optimizers

    def states() -> None:
        tracker.tag(optimizer_states(optimizers), "optimizer_state")

    def clip(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            tracker.phase("clip")
            with tracker.region("optimizer_aux"):
                return fn(*args, **kwargs)

        return wrapped

    def step(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            tracker.phase("optimizer")
            with tracker.region("optimizer_aux"):
                out = fn(*args, **kwargs)
            states()
            return out

        return wrapped

    optimizers.clip_grad_norm_ = clip(optimizers.clip_grad_norm_)
    optimizers.step = step(optimizers.step)
