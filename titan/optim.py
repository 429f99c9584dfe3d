"""Optimizers: one torch optimizer per model part, checkpointed as a single FQN-keyed dict.

Pipeline parallelism splits the model into several parts (stages) per rank; each part gets its own
optimizer so a stage only touches its own parameters. The checkpoint state is produced with
``torch.distributed.checkpoint.state_dict`` and ``flatten_optimizer_state_dict=True``: keys are
parameter FQNs ("state.layers.0.attention.wq.weight.exp_avg", "param_groups.<fqn>.lr"), not
positional ids, so a checkpoint saved with one split (or none, or FSDP/DTensor params) loads into
another split of the same model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from titan.config.job_config import Optimizer as OptimizerConfig
from titan.errors import TitanError

__all__ = ["OptimizersContainer", "build_optimizers", "OPTIMIZERS", "IMPLEMENTATIONS"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "AdamW": torch.optim.AdamW,
    "Adam": torch.optim.Adam,
}
# implementation name -> constructor kwargs. "for-loop" forces the per-tensor path: torch would
# otherwise silently pick foreach when foreach=None.
IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
}

_STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizersContainer:
    """Holds ``optimizers[i]`` for ``model_parts[i]`` and steps / checkpoints them together.

    Implements the ``Stateful`` protocol (state_dict / load_state_dict) so the checkpoint manager
    can register it directly.
    """

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
    ) -> None:
        self.model_parts = list(model_parts)
        self.optimizer_kwargs = dict(optimizer_kwargs)
        self.optimizers: list[torch.optim.Optimizer] = []
        for part in self.model_parts:
            params = [p for p in part.parameters() if p.requires_grad]
            self.optimizers.append(optimizer_cls(params, **self.optimizer_kwargs))
        self._post_step_hooks: list[Callable[[], None]] = []

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()
        for hook in self._post_step_hooks:
            hook()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def register_step_post_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` once after every container step (e.g. float8 scale precompute), after all
        parts have stepped."""
        self._post_step_hooks.append(hook)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, optimizer in zip(self.model_parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, optimizer, options=_STATE_DICT_OPTIONS))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part picks the FQN keys of its own parameters out of the merged dict.
        for part, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(
                part, optimizer, optim_state_dict=state_dict, options=_STATE_DICT_OPTIONS
            )


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise TitanError(message)


def validate_optimizer_config(cfg: OptimizerConfig) -> None:
    """Raise TitanError naming the first invalid [optimizer] key."""
    names = {n.lower(): n for n in OPTIMIZERS}
    _check(
        cfg.name.lower() in names,
        f"optimizer.name must be one of {', '.join(OPTIMIZERS)}, got {cfg.name!r}",
    )
    _check(
        math.isfinite(cfg.lr) and cfg.lr > 0, f"optimizer.lr must be > 0, got {cfg.lr}"
    )
    for key in ("beta1", "beta2"):
        value = getattr(cfg, key)
        _check(0.0 <= value < 1.0, f"optimizer.{key} must be in [0, 1), got {value}")
    _check(
        math.isfinite(cfg.eps) and cfg.eps >= 0, f"optimizer.eps must be >= 0, got {cfg.eps}"
    )
    _check(
        math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0,
        f"optimizer.weight_decay must be >= 0, got {cfg.weight_decay}",
    )
    _check(
        cfg.implementation in IMPLEMENTATIONS,
        f"optimizer.implementation must be one of {', '.join(IMPLEMENTATIONS)}, "
        f"got {cfg.implementation!r}",
    )


def build_optimizers(
    model_parts: list[nn.Module], cfg: OptimizerConfig
) -> OptimizersContainer:
    """Build one optimizer per model part from the [optimizer] config section.

    Weight decay applies to every parameter (as in Llama 3 / torchtitan); the container keeps a
    single param group per part so the FQN-keyed checkpoint stays layout independent.
    """
    validate_optimizer_config(cfg)
    name = {n.lower(): n for n in OPTIMIZERS}[cfg.name.lower()]
    kwargs: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        **IMPLEMENTATIONS[cfg.implementation],
    }
    if cfg.implementation == "fused":
        _check_fused_supported(model_parts)
    return OptimizersContainer(model_parts, OPTIMIZERS[name], kwargs)


def _fused_devices() -> list[str]:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # private helper moved: let torch itself complain at step time
        return []


def _check_fused_supported(model_parts: list[nn.Module]) -> None:
    """Fail at build time, not at the first step (torch only checks fused support in step())."""
    supported = _fused_devices()
    if not supported:
        return
    for part in model_parts:
        for fqn, p in part.named_parameters():
            if p.requires_grad and (
                p.device.type not in supported or not torch.is_floating_point(p)
            ):
                raise TitanError(
                    f"optimizer.implementation=fused is not supported for parameter {fqn} "
                    f"({p.dtype} on {p.device.type}; fused needs floating point on one of "
                    f"{', '.join(supported)}); use foreach or for-loop"
                )
