"""Optimizers: one torch optimizer per model part, checkpointed as a single FQN-keyed dict.

Pipeline parallelism splits the model into several parts (stages) per rank; each part gets its own
optimizer so a stage only touches its own parameters. The checkpoint state is produced with
``torch.distributed.checkpoint.state_dict`` and ``flatten_optimizer_state_dict=True``: keys are
parameter FQNs ("state.layers.0.attention.wq.weight.exp_avg", "param_groups.<fqn>.lr"), not
positional ids, so a checkpoint saved with one split (or none, or FSDP/DTensor params) loads into
another split of the same model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from titan.config.job_config import Optimizer as OptimizerConfig
from titan.errors import TitanError, require
from titan.log import import_torchao
from titan.parallel.utils import clip_grad_norm_
from titan.training.muon import Muon, split_muon_params

__all__ = [
    "OptimizersContainer",
    "build_optimizers",
    "OPTIMIZERS",
    "IMPLEMENTATIONS",
    "param_groups",
    "WEIGHT_DECAY_EXCLUDE",
    "resolve_implementation",
]

OPTIMIZERS: Mapping[str, type[torch.optim.Optimizer]] = MappingProxyType(
    {
        "AdamW": torch.optim.AdamW,
        "Adam": torch.optim.Adam,
        "Muon": Muon,  # with AdamW for the parameters that are not hidden matrices (titan.training.muon)
    }
)
# optimizer.implementation choice -> constructor kwargs. "for-loop" forces the per-tensor path: torch would
# otherwise silently pick foreach when foreach=None.
IMPLEMENTATIONS: Mapping[str, Mapping[str, bool]] = MappingProxyType(
    {
        "for-loop": MappingProxyType({"foreach": False, "fused": False}),
        "foreach": MappingProxyType({"foreach": True, "fused": False}),
        "fused": MappingProxyType({"foreach": False, "fused": True}),
    }
)

_STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

# optimizer.weight_decay_exclude kinds -> does this module's own parameters belong to the kind.
# Norms by class name so any norm class (RMSNorm, LayerNorm, wrapped by FSDP or not) matches.
WEIGHT_DECAY_EXCLUDE: Mapping[str, Callable[[nn.Module], bool]] = MappingProxyType(
    {
        "norms": lambda m: "Norm" in type(m).__name__,
        "embeddings": lambda m: isinstance(m, nn.Embedding),
    }
)


def param_groups(
    part: nn.Module, exclude: Sequence[str] = (), only: Sequence[nn.Parameter] | None = None
) -> list[dict[str, Any]]:
    """One group of all trainable parameters (or of ``only``), or with ``exclude`` a second group with weight
    decay 0 for the parameters of the excluded module kinds (a shared/tied parameter is excluded
    if any module holding it is). The checkpoint stays layout independent: the flattened state
    dict stores each group's hyper-parameters per parameter FQN."""
    params = [p for p in part.parameters() if p.requires_grad] if only is None else list(only)
    if not exclude:
        return [{"params": params}]
    checks = [WEIGHT_DECAY_EXCLUDE[kind] for kind in exclude]
    skip = {id(p) for m in part.modules() if any(check(m) for check in checks) for p in m.parameters(recurse=False)}
    groups = [
        {"params": [p for p in params if id(p) not in skip]},
        {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


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
        weight_decay_exclude: Sequence[str] = (),
    ) -> None:
        self.model_parts = list(model_parts)
        self.optimizer_kwargs = dict(optimizer_kwargs)
        self._post_step_hooks: list[Callable[[], None]] = []
        # part_optimizers[i]: the optimizers of model_parts[i] (one here; one per parameter in a subclass).
        self.part_optimizers = [
            self._build_part(part, optimizer_cls, weight_decay_exclude) for part in self.model_parts
        ]
        self.optimizers = [o for optimizers in self.part_optimizers for o in optimizers]

    def _build_part(
        self, part: nn.Module, optimizer_cls: type[torch.optim.Optimizer], weight_decay_exclude: Sequence[str]
    ) -> list[torch.optim.Optimizer]:
        if optimizer_cls is Muon:
            return _muon_and_adamw(part, self.optimizer_kwargs, weight_decay_exclude)
        return [optimizer_cls(param_groups(part, weight_decay_exclude), **self.optimizer_kwargs)]

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

    def clip_grad_norm_(
        self, params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """Clip the gradients of `params` to max_norm (if > 0); returns their total norm before clipping."""
        return clip_grad_norm_(params, max_norm, pp_group)

    def register_step_post_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` once after every container step (e.g. float8 scale precompute), after all
        parts have stepped."""
        self._post_step_hooks.append(hook)

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, optimizers in zip(self.model_parts, self.part_optimizers):
            merged.update(get_optimizer_state_dict(part, optimizers, options=_STATE_DICT_OPTIONS))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Each part picks the FQN keys of its own parameters out of the merged dict.
        for part, optimizers in zip(self.model_parts, self.part_optimizers):
            set_optimizer_state_dict(part, optimizers, optim_state_dict=state_dict, options=_STATE_DICT_OPTIONS)


def validate_optimizer_config(cfg: OptimizerConfig) -> None:
    """The name against this module's optimizer table (matched case-insensitively); the ranges are
    Optimizer.validate's (load_config)."""
    require(cfg.name.lower() in {n.lower() for n in OPTIMIZERS}, "optimizer.name", cfg.name, ", ".join(OPTIMIZERS))


def build_optimizers(
    model_parts: list[nn.Module], cfg: OptimizerConfig, container: type[OptimizersContainer] = OptimizersContainer
) -> OptimizersContainer:
    """Build one optimizer per model part from the [optimizer] config section.

    Weight decay applies to every parameter (as in Llama 3 / torchtitan) unless
    ``weight_decay_exclude`` names module kinds to spare. With ``bf16_stochastic_round`` the
    parameters must already be bf16 (see ``cast_params_for_optimizer``). ``cfg`` has passed
    validate_optimizer_config (titan.training.checks.validate_job). ``container``: this module's,
    or titan.training.optim_in_backward's for optimizer.early_step_in_backward.
    """
    if cfg.bf16_stochastic_round:
        return container(
            model_parts,
            _bf16_sr_adamw(),
            {
                "lr": cfg.lr,
                "betas": (cfg.beta1, cfg.beta2),
                "eps": cfg.eps,
                "weight_decay": cfg.weight_decay,
                "bf16_stochastic_round": True,
            },
            cfg.weight_decay_exclude,
        )
    name = {n.lower(): n for n in OPTIMIZERS}[cfg.name.lower()]
    implementation = resolve_implementation(cfg, model_parts)
    kwargs: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        **IMPLEMENTATIONS[implementation],
    }
    if implementation == "fused":
        _check_fused_supported(model_parts)
    if name == "Muon":
        kwargs["muon"] = {
            "momentum": cfg.momentum,
            "nesterov": cfg.nesterov,
            "ns_steps": cfg.ns_steps,
            "adjust_lr_fn": cfg.adjust_lr_fn,
            "balance": {},  # one per container: the owners of every part's matrices balance together
        }
        kwargs["router_gate"] = cfg.muon_router_gate
        kwargs["adamw"] = {
            "lr": cfg.lr if cfg.adamw_lr is None else cfg.adamw_lr,
            "weight_decay": cfg.weight_decay if cfg.adamw_weight_decay is None else cfg.adamw_weight_decay,
        }
    return container(model_parts, OPTIMIZERS[name], kwargs, cfg.weight_decay_exclude)


def _muon_and_adamw(
    part: nn.Module, kwargs: dict[str, Any], weight_decay_exclude: Sequence[str]
) -> list[torch.optim.Optimizer]:
    """One optimizer: Muon over the part's hidden matrices, torch's AdamW (inside it) over the rest;
    a pipeline stage without matrices gets the AdamW alone."""
    matrices, others = split_muon_params(part, kwargs["router_gate"])
    adamw_kwargs = {k: v for k, v in kwargs.items() if k not in ("muon", "adamw", "router_gate")} | kwargs["adamw"]
    adamw_groups = param_groups(part, weight_decay_exclude, others) if others else None
    if not matrices:
        return [torch.optim.AdamW(adamw_groups or [], **adamw_kwargs)]
    muon = Muon(
        matrices,
        lr=kwargs["lr"],
        weight_decay=kwargs["weight_decay"],
        **kwargs["muon"],
        adamw_groups=adamw_groups,
        adamw_kwargs=adamw_kwargs,
    )
    return [muon]


def resolve_implementation(cfg: OptimizerConfig, model_parts: Sequence[nn.Module] = ()) -> str:
    """optimizer.implementation with auto resolved: fused where torch has a fused Adam kernel for
    every parameter's device and dtype (torchtitan's default), foreach otherwise and with
    bf16_stochastic_round."""
    if cfg.implementation != "auto":
        return cfg.implementation
    if cfg.bf16_stochastic_round:
        return "foreach"
    supported = _fused_devices()
    fits = all(
        p.device.type in supported and torch.is_floating_point(p)
        for part in model_parts
        for p in part.parameters()
        if p.requires_grad
    )
    return "fused" if supported and fits else "foreach"


def _bf16_sr_adamw() -> type[torch.optim.Optimizer]:
    """torchao's plain AdamW with bf16 stochastic rounding (fp32 math, fp32 moments, the new bf16
    weight rounded up with probability = the dropped fraction): torchao.optim._AdamW."""
    try:
        return import_torchao("torchao.optim")._AdamW
    except (ImportError, AttributeError):
        raise TitanError(
            "optimizer.bf16_stochastic_round needs torchao >= 0.18 (its torchao.optim._AdamW);"
            " pip install 'torchao>=0.18'"
        ) from None


def cast_params_for_optimizer(model: nn.Module, cfg: OptimizerConfig) -> None:
    """bf16_stochastic_round keeps the weights themselves in bf16. Call on the meta-device model,
    before parallelizing (FSDP then shards bf16 parameters) and before init (so the weights are
    drawn in bf16). Buffers keep their dtype; tied parameters stay tied."""
    if not cfg.bf16_stochastic_round:
        return
    new: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old kept alive, new)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != torch.bfloat16:
                if id(p) not in new:
                    new[id(p)] = (p, nn.Parameter(p.detach().to(torch.bfloat16), p.requires_grad))
                module.register_parameter(name, new[id(p)][1])


def _fused_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

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
            if p.requires_grad and (p.device.type not in supported or not torch.is_floating_point(p)):
                raise TitanError(
                    f"optimizer.implementation=fused is not supported for parameter {fqn} "
                    f"({p.dtype} on {p.device.type}; fused needs floating point on one of "
                    f"{', '.join(supported)}); use foreach or for-loop"
                )
