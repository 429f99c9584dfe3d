"""Muon for the hidden matrices, AdamW for everything else (optimizer.name = "Muon").

Which parameter is which is decided by role, not by name, so every model family built from titan's
blocks is covered without listing it: embeddings (nn.Embedding), the model's output projection (its
``output`` module, tied or not), the MoE router's gate, biases of any shape (nn.Linear's, the
routed experts' per-expert [E, width] ones) and every parameter of fewer than two dims (norms,
sinks) go to AdamW; every other 2-D parameter (attention and feed-forward projections, shared
experts) and every 3-D [E, A, B] parameter (routed experts: one matrix per expert) goes to Muon.

The arithmetic is torch.optim.Muon's (its Newton-Schulz iteration and coefficients, run here on
stacks of same-shape matrices at once, its lr adjustment); what titan adds is that a matrix
sharded by FSDP, TP or EP is orthogonalised whole, on one rank, with the work spread over the
ranks and the memory bounded by the shard (titan.parallel.muon).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr  # torch's Muon arithmetic

from titan.models.moe.experts import GroupedExperts
from titan.models.moe.router import TokenChoiceTopKRouter
from titan.parallel.muon import WholeMatrixUpdates
from titan.parallel.muon_layout import Layout, fsdp_layout, local

__all__ = ["Muon", "split_muon_params", "NS_COEFFICIENTS", "newton_schulz_", "muon_memory"]

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
_BF16 = 2
_BLOCK = 1 << 20
"""The last product of an iteration runs in column blocks of about this many elements (at least a
quarter of the short side squared), so it needs no second copy of a large matrix."""


def _adamw_roles(part: nn.Module, router_gate: bool) -> set[int]:
    """ids of the parameters AdamW keeps whatever their shape: embeddings, the output projection,
    router gates (unless ``router_gate``: their weight then goes to Muon), biases."""
    ids = set()
    for m in part.modules():
        if isinstance(m, nn.Embedding):
            ids |= {id(p) for p in m.parameters()}
        elif isinstance(m, TokenChoiceTopKRouter):
            ids |= {id(p) for p in m.parameters() if not router_gate or p.ndim != 2}
        elif isinstance(m, nn.Linear) and m.bias is not None:
            ids.add(id(m.bias))
        elif isinstance(m, GroupedExperts):  # per-expert vectors [E, width]: the experts' biases
            ids |= {id(p) for p in m.parameters(recurse=False) if p.ndim == 2}
    output = getattr(part, "output", None)
    if isinstance(output, nn.Module):
        ids |= {id(p) for p in output.parameters()}
    return ids


def split_muon_params(part: nn.Module, router_gate: bool = False) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's matrices, AdamW's parameters) of ``part``'s trainable parameters, in module order;
    ``router_gate``: optimizer.muon_router_gate."""
    adamw = _adamw_roles(part, router_gate)
    params = [p for p in part.parameters() if p.requires_grad]
    matrices = [p for p in params if p.ndim in (2, 3) and id(p) not in adamw]
    chosen = {id(p) for p in matrices}
    return matrices, [p for p in params if id(p) not in chosen]


def _block(short: int, long: int) -> int:
    return min(long, max(1, _BLOCK // short, short // 4))


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Newton-Schulz FLOPs of one matrix: per iteration X X^T, (b G + c G G), and (a I + ...) X."""
    s, n = min(rows, cols), max(rows, cols)
    return steps * 2 * (2 * s * s * n + s**3)


def ns_workspace(k: int, rows: int, cols: int) -> int:
    """Bytes newton_schulz_ allocates on a [k, rows, cols] stack: two Gram-sized matrices and a
    column block."""
    s, n = min(rows, cols), max(rows, cols)
    return _BF16 * k * (2 * s * s + s * _block(s, n))


def _same_memory_contiguous(x: torch.Tensor) -> torch.Tensor | None:
    """``x``'s memory as a contiguous tensor of ``x``'s shape (``x`` itself, or its transpose's
    storage reread), or None where ``x`` is neither contiguous nor a transposed contiguous one."""
    if x.is_contiguous():
        return x
    if x.mT.is_contiguous():
        return x.mT.view(-1).view(x.shape)
    return None


def newton_schulz_(x: torch.Tensor, steps: int, eps: float = EPS) -> None:
    """torch.optim.Muon's Newton-Schulz iteration on each matrix of a bfloat16 [k, s, n] stack
    (s <= n; a view), in place: each matrix divided by its Frobenius norm, then per iteration
    G = X X^T, H = b G + c G G, X = a X + H X. Equal to torch's ``_zeropower_via_newtonschulz`` on
    each matrix (bit for bit on CPU; a test checks it); it keeps the Gram matrices and the next X
    in buffers it reuses. Where one column block spans the matrix (n up to about ``_BLOCK / s``),
    the next X goes into a whole contiguous buffer and X's own memory, reread contiguous, is the
    other one: the two swap, so X is copied back once at the end, not once per iteration, and every
    product after the first writes contiguous memory as torch's does. A wider matrix computes the
    next X a column block at a time into the current one."""
    a, b, c = NS_COEFFICIENTS
    k, s, n = x.shape
    x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
    gram, poly = x.new_empty(k, s, s), x.new_empty(k, s, s)
    width = _block(s, n)
    scratch = x.new_empty(k, s, width)
    spare = _same_memory_contiguous(x) if width == n else None
    if spare is None:
        for _ in range(steps):
            torch.bmm(x, x.mT, out=gram)
            torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
            for j in range(0, n, width):
                cols = x[..., j : j + width]
                out = scratch[..., : cols.shape[-1]]
                torch.baddbmm(cols, poly, cols, beta=a, out=out)
                cols.copy_(out)
        return
    current = x
    for _ in range(steps):
        torch.bmm(current, current.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        torch.baddbmm(current, poly, current, beta=a, out=scratch)
        current, scratch = scratch, spare if current is x else current
    if current is spare and spare is not x:  # X's memory in the other layout: it goes back through the buffer
        scratch.copy_(current)
        current = scratch
    if current is not x:
        x.copy_(current)


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's update for 2-D matrices and 3-D stacks of them ([E, A, B]: each of the E
    matrices orthogonalised on its own), on plain or DTensor parameters.

    ``adamw_groups`` (parameter groups, ``adamw_kwargs``) are stepped by torch's AdamW inside this
    optimizer: their groups and states are this optimizer's too, so the lr schedule (one set of base
    lrs, per group) and the checkpoint see one optimizer whatever lr or decay each part has.

    Per step and matrix: momentum ``B = mu B + (1 - mu) g`` (torch's lerp form), Nesterov
    ``g + mu (B - g)`` or B, Newton-Schulz orthogonalisation of the whole matrix (on its owner
    rank), decoupled weight decay ``W *= 1 - lr wd``, then ``W -= adjust(lr, A, B) O``. One state
    tensor per matrix: ``momentum_buffer``, sharded like the parameter. ``share``: bytes of one
    rank's part of a bucket (default: a quarter of the memory budget; tests set it small).
    ``balance``: one dict shared by the Muon of every model part of a rank (pipeline stages), so
    that their matrices' owners are balanced together.
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
        share: int | None = None,
        balance: dict | None = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "eps": eps,
        }
        super().__init__(list(params), defaults)
        self._muon_groups = len(self.param_groups)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        self.updates = whole_matrix_updates(self._params, self._group_of, self.param_groups, share, balance=balance)
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

    def _group(self, i: int) -> dict[str, Any]:
        return self.param_groups[self._group_of[i]]

    def _update(self, i: int, index: tuple, out: torch.Tensor) -> bool:
        p = self._params[i]
        if p.grad is None:
            return False
        grad, buf = local(p.grad)[index], local(self.state[p]["momentum_buffer"])[index]
        if self._group(i)["nesterov"]:
            torch.lerp(grad, buf, self._group(i)["momentum"], out=out)  # fp32 arithmetic, rounded on store
        else:
            out.copy_(buf)
        return True

    def _orthogonalise(self, x: torch.Tensor, i: int) -> None:
        group = self._group(i)
        newton_schulz_(x, group["ns_steps"], group["eps"])

    def _apply(self, i: int, index: tuple, ortho: torch.Tensor) -> None:
        p, group = self._params[i], self._group(i)
        if p.grad is None:
            return
        lr = group["lr"]
        weight = local(p)[index]
        weight.mul_(1 - lr * group["weight_decay"])
        weight.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], torch.Size(p.shape[-2:])))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: ANN401 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, p in enumerate(self._params):
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            local(state["momentum_buffer"]).lerp_(local(p.grad), 1 - self._group(i)["momentum"])
        if self._params:
            device = local(self._params[0]).device
            self.updates.run(self._update, self._orthogonalise, self._apply, device)
        if self.adamw is not None:
            self.adamw.step()
        return loss


def whole_matrix_updates(
    params: Sequence[torch.Tensor],
    group_of: Sequence[int],
    groups: Sequence[dict[str, Any]],
    share: int | None = None,
    layouts: Sequence[Layout] | None = None,
    balance: dict | None = None,
) -> WholeMatrixUpdates:
    """The plan of Muon's matrices: owners balanced by Newton-Schulz FLOPs, buckets and stacks
    within the bytes of the one state AdamW keeps and Muon does not (its second moment)."""
    flops = [ns_flops(p.shape[-2], p.shape[-1], groups[g]["ns_steps"]) for p, g in zip(params, group_of)]
    return WholeMatrixUpdates(params, flops, group_of, ns_workspace, share=share, layouts=layouts, loads=balance)


def muon_memory(
    part: nn.Module,
    shards: int | None = None,
    ns_steps: int = 5,
    router_gate: bool = False,
    balance: dict | None = None,
) -> dict[str, int]:
    """Muon's per-rank ``optimizer_state`` (momentum of the matrices, AdamW's two moments for the
    rest) and ``optimizer_aux`` (the step's buffers: an upper bound over the ranks) in bytes, for a
    parallelized model part (DTensor parameters, real or fake process group; meta tensors are
    fine), or for a plain one sharded as FSDP would over ``shards`` ranks (the memory estimate)."""
    matrices, others = split_muon_params(part, router_gate)
    layouts = None
    if shards is not None:
        tilings: dict = {}
        layouts = [fsdp_layout(tuple(p.shape), shards, 0, tilings) for p in matrices]

    def rank_numel(p: torch.Tensor) -> int:  # FSDP's padded dim-0 shard, or this rank's own
        if shards is None:
            return local(p).numel()
        return p.numel() if p.ndim == 0 else -(-p.shape[0] // shards) * (p.numel() // max(p.shape[0], 1))

    state = sum(rank_numel(p) * p.element_size() for p in matrices)
    state += sum(2 * rank_numel(p) * p.element_size() for p in others)
    if not matrices:
        return {"optimizer_state": state, "optimizer_aux": 0}
    groups = [{"ns_steps": ns_steps}]
    updates = whole_matrix_updates(matrices, [0] * len(matrices), groups, layouts=layouts, balance=balance)
    return {"optimizer_state": state, "optimizer_aux": updates.peak()}
