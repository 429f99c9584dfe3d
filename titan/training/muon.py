"""Muon for the hidden matrices, AdamW for everything else (optimizer.name = "Muon").

Which parameter is which is decided by role, not by name, so every model family built from titan's
blocks is covered without listing it: embeddings (nn.Embedding), the model's output projection (its
``output`` module, tied or not), the MoE router's gate and every parameter of fewer than two dims
(norms, biases) go to AdamW; every other 2-D parameter (attention and feed-forward projections,
shared experts) and every 3-D [E, A, B] parameter (routed experts: one matrix per expert) goes to
Muon.

The arithmetic is torch.optim.Muon's (its Newton-Schulz iteration, coefficients, step count and
lr adjustment); what titan adds is that a matrix sharded by FSDP, TP or EP is orthogonalised whole,
on one rank, with the work spread over the ranks (titan.parallel.muon).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.optim._muon import (  # torch's Muon arithmetic, reused as is
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

from titan.models.moe.router import TokenChoiceTopKRouter
from titan.parallel.muon import MatrixRouter, local

__all__ = ["Muon", "split_muon_params", "NS_COEFFICIENTS"]

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def _adamw_roles(part: nn.Module) -> set[int]:
    """ids of the parameters AdamW keeps whatever their shape: embeddings, the output projection,
    router gates."""
    modules: list[nn.Module] = [m for m in part.modules() if isinstance(m, (nn.Embedding, TokenChoiceTopKRouter))]
    output = getattr(part, "output", None)
    if isinstance(output, nn.Module):
        modules.append(output)
    return {id(p) for m in modules for p in m.parameters()}


def split_muon_params(part: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's matrices, AdamW's parameters) of ``part``'s trainable parameters, in module order."""
    adamw = _adamw_roles(part)
    params = [p for p in part.parameters() if p.requires_grad]
    matrices = [p for p in params if p.ndim in (2, 3) and id(p) not in adamw]
    chosen = {id(p) for p in matrices}
    return matrices, [p for p in params if id(p) not in chosen]


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update for 2-D matrices and 3-D stacks of them ([E, A, B]: each of the E
    matrices orthogonalised on its own), on plain or DTensor parameters.

    ``adamw_groups`` (parameter groups, ``adamw_kwargs``) are stepped by torch's AdamW inside this
    optimizer: their groups and states are this optimizer's too, so the lr schedule (one set of base
    lrs, per group) and the checkpoint see one optimizer whatever lr or decay each part has.

    Per step and matrix: momentum ``B = mu B + (1 - mu) g`` (torch's lerp form), Nesterov
    ``g + mu (B - g)`` or B, Newton-Schulz orthogonalisation of the whole matrix (on its owner
    rank), decoupled weight decay ``W *= 1 - lr wd``, then ``W -= adjust(lr, A, B) O``. One state
    tensor per matrix: ``momentum_buffer``, sharded like the parameter.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
        eps: float = EPS,
        adamw_groups: list[dict[str, Any]] | None = None,
        adamw_kwargs: dict[str, Any] | None = None,
    ) -> None:
        params = list(params)
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "eps": eps,
        }
        super().__init__(params, defaults)
        self.router = MatrixRouter(params)
        self._muon_groups = len(self.param_groups)
        self.adamw = torch.optim.AdamW(adamw_groups, **(adamw_kwargs or {})) if adamw_groups else None
        if self.adamw is not None:
            self.param_groups.extend(self.adamw.param_groups)
            self._share_with_adamw()

    def _share_with_adamw(self) -> None:
        """AdamW steps this optimizer's own group dicts and state (after construction and after
        load_state_dict, which replaces both)."""
        if self.adamw is not None:
            self.adamw.param_groups = self.param_groups[self._muon_groups :]
            self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share_with_adamw()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: ANN401 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups[: self._muon_groups]:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]

            def orthogonalise(m: torch.Tensor, group: dict[str, Any] = group) -> torch.Tensor:
                return _zeropower_via_newtonschulz(m, NS_COEFFICIENTS, group["ns_steps"], group["eps"])

            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                grad, buf = local(p.grad), local(state["momentum_buffer"])
                buf.lerp_(grad, 1 - mu)
                # A copy either way: Newton-Schulz scales its bfloat16 input in place, which must
                # not be the momentum itself (a bf16 buffer with nesterov off).
                update = grad.lerp(buf, mu) if group["nesterov"] else buf.clone()
                ortho = self.router.apply(p, update, orthogonalise)
                weight = local(p)
                weight.mul_(1 - lr * wd)
                weight.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], torch.Size(p.shape[-2:])))
        if self.adamw is not None:
            self.adamw.step()
        return loss
