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
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from titan.errors import TitanError
from titan.training.optim import _STATE_DICT_OPTIONS, OptimizersContainer, param_groups

__all__ = ["OptimizersInBackward", "check_step_in_backward"]


def check_step_in_backward(cfg, training, dims) -> None:  # noqa: ANN001 - config sections, ParallelDims
    """One line naming everything set that cannot run with the step in backward."""
    if not cfg.early_step_in_backward:
        return
    clashes = [what for what, on in (
        (f"grad clipping (training.max_norm = {training.max_norm}; set it to 0)", training.max_norm > 0),
        ("gradient accumulation (training.global_batch_size > local_batch_size x data-parallel degree)",
         training.global_batch_size not in (-1, training.local_batch_size * dims.dp_degree)),
        ("pipeline parallel (parallelism.pipeline_parallel_degree > 1)", dims.pp_enabled),
        ("DDP (data_parallel_replicate_degree > 1 without sharding; use FSDP or HSDP)",
         dims.dp_replicate_enabled and not dims.fsdp_enabled),
        ("training.nonfinite = skip_step (the step is taken before the check)", training.nonfinite == "skip_step"),
    ) if on]
    if clashes:
        raise TitanError("optimizer.early_step_in_backward steps each parameter before the whole gradient exists,"
                         " so it cannot run with " + "; ".join(clashes))


def _square_share(grad: torch.Tensor, world: int) -> torch.Tensor:
    """This rank's share of sum(grad^2) such that the sum over all ranks counts every element once:
    a DTensor's local shard is held by world / (product of its sharded mesh dims) ranks."""
    local, shards = grad, 1
    if isinstance(grad, DTensor):
        local = grad.to_local()
        shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if not p.is_replicate())
    return local.detach().float().pow(2).sum() * (shards / world)


class OptimizersInBackward(OptimizersContainer):
    """One optimizer per parameter, stepped in backward; ``optimizers`` lists them all (the LR
    schedulers drive each), ``part_optimizers[i]`` those of ``model_parts[i]``."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        weight_decay_exclude: list[str] | tuple[str, ...] = (),
    ) -> None:
        self.model_parts = list(model_parts)
        self.optimizer_kwargs = dict(optimizer_kwargs)
        self._post_step_hooks = []
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._square_sum: torch.Tensor | None = None
        self.part_optimizers: list[list[torch.optim.Optimizer]] = []
        for part in self.model_parts:
            optimizers = []
            for group in param_groups(part, weight_decay_exclude):
                for param in group["params"]:
                    optimizer = optimizer_cls([{**group, "params": [param]}], **self.optimizer_kwargs)
                    param.register_post_accumulate_grad_hook(self._hook(optimizer))
                    optimizers.append(optimizer)
            self.part_optimizers.append(optimizers)
        self.optimizers = [o for optimizers in self.part_optimizers for o in optimizers]

    def _hook(self, optimizer: torch.optim.Optimizer):  # noqa: ANN202
        def step_and_free(param: torch.Tensor) -> None:
            # The norm is only reported (clipping is refused): its share is summed without a sync.
            share = _square_share(param.grad, self._world)
            self._square_sum = share if self._square_sum is None else self._square_sum + share.to(self._square_sum.device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step_and_free

    def step(self) -> None:
        """The parameters stepped in backward; only the post-step hooks are left to run."""
        for hook in self._post_step_hooks:
            hook()

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None
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

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, optimizers in zip(self.model_parts, self.part_optimizers):
            merged.update(get_optimizer_state_dict(part, optimizers, options=_STATE_DICT_OPTIONS))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, optimizers in zip(self.model_parts, self.part_optimizers):
            set_optimizer_state_dict(part, optimizers, optim_state_dict=state_dict, options=_STATE_DICT_OPTIONS)
