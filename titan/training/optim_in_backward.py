"""The optimizer step inside backward (optimizer.early_step_in_backward).

Every parameter gets its own optimizer, stepped by a post-accumulate-grad hook as soon as its
gradient is complete (with FSDP2: reduce-scattered, and on the host under CPU offload), and the
gradient is freed right after: the whole model's gradients never exist at once. With one param
group per optimizer the update of each parameter is exactly the ordinary one, so the losses equal
an ordinary step's, as long as nothing needs all gradients before the first update: clipping,
accumulation over micro-batches, pipeline stages (several backwards per step), DDP (its all-reduce
lands after the hook), a skipped step. Those are refused by ``check_step_in_backward``.

The container keeps the ordinary container's interface: ``step()`` runs only the post-step hooks
(float8 scale precompute), ``zero_grad()`` finds nothing left to free, and the checkpoint holds the
same FQN-keyed state as the ordinary container's, so either loads the other's checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from titan.config.sections.optimizer import Optimizer
from titan.config.sections.training import Training
from titan.errors import TitanError
from titan.parallel.dims import ParallelDims
from titan.training.optim import OptimizersContainer, param_groups

__all__ = ["OptimizersInBackward", "check_step_in_backward"]


def check_step_in_backward(cfg: Optimizer, training: Training, dims: ParallelDims) -> None:
    """One line naming everything set that cannot run with the step in backward."""
    if not cfg.early_step_in_backward:
        return
    clashes = [
        what
        for what, on in (
            (f"grad clipping (training.max_norm = {training.max_norm}; set it to 0)", training.max_norm > 0),
            (
                "gradient accumulation (training.global_batch_size > local_batch_size x data-parallel degree)",
                training.global_batch_size not in (-1, training.local_batch_size * dims.dp_degree),
            ),
            ("pipeline parallel (parallelism.pipeline_parallel_degree > 1)", dims.pp_enabled),
            (
                "DDP (data_parallel_replicate_degree > 1 without sharding; use FSDP or HSDP)",
                dims.dp_replicate_enabled and not dims.fsdp_enabled,
            ),
            ("training.nonfinite = skip_step (the step is taken before the check)", training.nonfinite == "skip_step"),
        )
        if on
    ]
    if clashes:
        raise TitanError(
            "optimizer.early_step_in_backward steps each parameter before the whole gradient exists,"
            " so it cannot run with " + "; ".join(clashes)
        )


def _square_share(grad: torch.Tensor, world: int) -> torch.Tensor:
    """This rank's share of sum(grad^2) such that the sum over all ranks counts every element once:
    a DTensor's local shard is held by world / (product of its sharded mesh dims) ranks."""
    local, shards = grad, 1
    if isinstance(grad, DTensor):
        if any(p.is_partial() for p in grad.placements):
            # Pending sums (a tensor-parallel replicated weight's grad) must be reduced before squaring.
            grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
        local = grad.to_local()
        shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if not p.is_replicate())
    return local.detach().float().pow(2).sum() * (shards / world)


class OptimizersInBackward(OptimizersContainer):
    """One optimizer per parameter, stepped in backward; ``optimizers`` lists them all (the LR
    schedulers drive each), ``part_optimizers[i]`` those of ``model_parts[i]``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._square_sum: torch.Tensor | None = None
        super().__init__(*args, **kwargs)

    def _build_part(
        self, part: nn.Module, optimizer_cls: type[torch.optim.Optimizer], weight_decay_exclude: Sequence[str]
    ) -> list[torch.optim.Optimizer]:
        optimizers = []
        for group in param_groups(part, weight_decay_exclude):
            for param in group["params"]:
                optimizer = optimizer_cls([{**group, "params": [param]}], **self.optimizer_kwargs)
                param.register_post_accumulate_grad_hook(self._hook(optimizer))
                optimizers.append(optimizer)
        return optimizers

    def _hook(self, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        def step_and_free(param: torch.Tensor) -> None:
            # The norm is only reported (clipping is refused): its share is summed without a sync.
            if param.grad is None:  # the hook runs after accumulation: never, but typed so
                return
            share = _square_share(param.grad, self._world)
            total = self._square_sum
            self._square_sum = share if total is None else total + share.to(total.device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step_and_free

    def step(self) -> None:
        """The parameters stepped in backward; only the post-step hooks are left to run."""
        for hook in self._post_step_hooks:
            hook()

    def clip_grad_norm_(
        self, params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """The L2 norm of the step's gradients, from the shares the hooks summed (max_norm is 0,
        check_step_in_backward refuses clipping; pp_group is None as PP is refused too)."""
        total = self._square_sum
        self._square_sum = None
        if total is None:  # no gradient reached any parameter
            total = torch.zeros((), device=params[0].device if params else "cpu")
        if self._world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.sqrt()
