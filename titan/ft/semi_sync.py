"""Semi-synchronous training across replica groups (fault_tolerance.semi_sync_method): torchft's
LocalSGD (the weights averaged every sync_steps inner steps) and DiLoCo (every sync_steps, an
outer optimizer steps on the averaged weight deltas; with num_fragments > 1 the model's fragments
are synchronized in turn, streaming DiLoCo), with torchtitan's settings: the outer optimizer is
SGD, lr 0.7, momentum 0.9, Nesterov, one per fragment.

Each group checkpoints its own semi-synchronous state (per rank: the global weights of the last
synchronization, the outer optimizers' state and the inner steps since), so a resumed group
continues the cycle exactly; a healing group takes the same state from its peer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan.config.sections.fault_tolerance import FaultTolerance
from titan.errors import TitanError

OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def fragment_fqns(model: nn.Module, cfg: FaultTolerance) -> list[list[str]]:
    """The module names of each fragment: module_fqns_per_model_fragment, or num_fragments
    contiguous runs of (embeddings, each layer, norm + output), the ends weighted as one layer each."""
    if cfg.module_fqns_per_model_fragment:
        return cfg.module_fqns_per_model_fragment
    layers = model.get_submodule("layers")
    # mtp: multi-token prediction's fusion parts (titan.models.mtp), beside the output head
    units = [["tok_embeddings"], *[[f"layers.{k}"] for k in layers._modules], ["norm", "output", "mtp"]]
    units = [[n for n in u if _has(model, n)] for u in units]
    n = cfg.num_fragments
    if n > len(units):
        raise TitanError(
            f"config key 'fault_tolerance.num_fragments' got {n}; valid: at most {len(units)} for this model"
            " (its layers plus the embeddings and the output)"
        )
    bounds = [round(i * len(units) / n) for i in range(n + 1)]
    return [[name for u in units[bounds[i] : bounds[i + 1]] for name in u] for i in range(n)]


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def split_fragments(model: nn.Module, cfg: FaultTolerance) -> list[nn.Module]:
    """The fragments as modules that hold (not copy) the model's submodules."""
    if cfg.num_fragments == 1 and not cfg.module_fqns_per_model_fragment:
        return [model]
    out = []
    for names in fragment_fqns(model, cfg):
        fragment = nn.Module()
        for name in names:
            if not _has(model, name):
                raise TitanError(
                    f"config key 'fault_tolerance.module_fqns_per_model_fragment' names {name!r}, which is not"
                    " a module of the model; valid: tok_embeddings, layers.<i>, norm, output"
                )
            fragment.add_module(name.replace(".", "_"), model.get_submodule(name))
        out.append(fragment)
    return out


class SemiSync:
    """torchft's LocalSGD or DiLoCo on the group's one model part and its optimizer (its hooks run
    after every inner optimizer step); a per-rank Stateful for the group's checkpoints."""

    def __init__(self, cfg: FaultTolerance, manager: Any, model: nn.Module, optimizer: torch.optim.Optimizer):
        from torchft import local_sgd

        self.cfg = cfg
        self.outer: list[torch.optim.Optimizer] = []
        if cfg.semi_sync_method == "local_sgd":
            self.algo: Any = local_sgd.LocalSGD(
                manager=manager, model=model, optimizer=optimizer, sync_every=cfg.sync_steps
            )
            self.fragments: list[Any] = []
        else:
            parts = split_fragments(model, cfg)
            self.outer = [
                torch.optim.SGD(
                    [p for p in f.parameters() if p.requires_grad], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True
                )
                for f in parts
            ]
            self.algo = local_sgd.DiLoCo(
                manager=manager,
                model_fragments=parts,
                inner_optimizer=optimizer,
                outer_optimizer=self.outer,
                sync_every=cfg.sync_steps,
                should_quantize=cfg.should_quantize,
                fragment_sync_delay=cfg.fragment_sync_delay,
                fragment_update_alpha=cfg.fragment_update_alpha,
            )
            self.fragments = list(self.algo._fragments)
        self.algo.__enter__()  # its optimizer hooks stay for the life of the process

    def state_dict(self) -> dict[str, Any]:
        return {
            "local_step": self.algo._local_step,
            "outer": [o.state_dict() for o in self.outer],
            "original": [{k: v.clone() for k, v in f.original_parameters.items()} for f in self.fragments],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.algo._local_step = int(state_dict["local_step"])
        for o, s in zip(self.outer, state_dict["outer"]):
            o.load_state_dict(s)
        for f, saved in zip(self.fragments, state_dict["original"]):
            for k, v in saved.items():
                f.original_parameters[k].copy_(v)
