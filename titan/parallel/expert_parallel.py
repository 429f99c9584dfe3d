"""Expert parallelism for a mixture-of-experts layer's routed experts.

The routed experts are a module with parameters ``w1``/``w3`` [E, hidden, dim] and ``w2`` [E, dim,
hidden] whose forward takes (tokens sorted by expert [T, dim], tokens per expert [E]) and returns
[T, dim], and optionally biases ``b1``/``b3`` [E, hidden] and ``b2`` [E, dim] with an int attribute
``down_bias_shares`` (how many partial outputs each ``b2`` is split over). ``ExpertParallel``
shards it: EP splits the experts (dim 0) over the ``ep`` mesh and moves
each token to the rank that owns its expert with an all-to-all, and back after; ETP also shards each
expert's hidden dim over the ``etp`` mesh (the TP ranks), so that every TP rank holds a slice of
every local expert, like the dense feed-forward under TP.

The all-to-all split sizes are the one device-to-host read of an MoE layer's forward (one
``tolist`` of the send and receive sizes together); everything else stays on the device. Fake
tensors (the scale simulator, scripts/simulate.py) hold no routing: there the split sizes are an
assumption, balanced by default (``assumed_split``; the experts module's ``simulated_load``
attribute, set by the simulator, scales what this rank receives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titan.log import logger

# Dim of each parameter that ETP shards: the experts' hidden dim (column-wise w1/w3 and their
# biases, row-wise w2). The down projection's bias b2 is whole on every TP rank: each adds 1 / TP of
# it to its partial output, so the sum over TP holds it once.
_HIDDEN_DIM = {"w1": 1, "w2": 2, "w3": 1, "b1": 1, "b3": 1}


def _tp_placement(pname: str) -> Shard | Replicate:
    return Replicate() if pname == "b2" else Shard(_HIDDEN_DIM[pname])


def _split_down_bias(module: Any, tp: int) -> None:
    if getattr(module, "b2", None) is not None:
        module.down_bias_shares = tp


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


class _Route:
    """The state one dispatch leaves for its combine: split sizes and the received-row order."""

    def __init__(self, send: list[int], recv: list[int], order: torch.Tensor, inverse: torch.Tensor) -> None:
        self.send, self.recv, self.order, self.inverse = send, recv, order, inverse


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor`` backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


def assumed_split(rows: int, ep: int, load: float) -> list[int]:
    """Split sizes where the routing is unknown (fake tensors): this rank's ``rows`` spread evenly
    over the ``ep`` ranks, and as many from each rank times ``load`` received (1: balanced)."""
    send = [rows // ep + (j < rows % ep) for j in range(ep)]
    return send + [round(load * rows / ep)] * ep


def dispatch(
    x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, ep: int, load: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, _Route]:
    """Send each token to the EP rank owning its expert.

    ``x`` [T, dim] sorted by global expert, ``counts`` [E] (E = ep x local experts) -> (the tokens
    this rank's experts process, sorted by local expert [T', dim], their counts [local experts], the
    route back). Rank j's experts are j*L .. j*L+L-1, as Shard(0) of the expert weights lays them out.
    ``load``: on fake tensors only, the assumed load of this rank's experts (see assumed_split)."""
    if counts.is_floating_point():
        # A mixed-precision cast would have rounded them (bf16: whole numbers exact only to 256).
        raise TypeError(f"EP dispatch needs integer token counts per expert, got {counts.dtype}")
    counts = counts.to(torch.int64)
    local = counts.numel() // ep
    with torch.no_grad():
        # recv[j * L + e]: tokens rank j sends to my local expert e.
        recv_counts = all_to_all_single(counts, None, None, group=group)
        recv_counts = torch.ops._c10d_functional.wait_tensor(recv_counts)
        sizes = torch.cat([counts.view(ep, local).sum(1), recv_counts.view(ep, local).sum(1)])
        # The layer's one host read: all_to_all needs its split sizes as Python ints.
        split = sizes.tolist()
    if is_fake(sizes) and not torch.compiler.is_compiling():  # no values: the stated assumption
        split = assumed_split(x.shape[0], ep, load)
    send, recv = split[:ep], split[ep:]
    received = all_to_all_single_autograd(x, recv, send, group)
    # Received rows come grouped by source rank, then local expert; the experts want them grouped
    # by local expert, then source rank. Build the gather index on the device (no host read: the
    # total is known from the split sizes).
    n = sum(recv)
    by_rank = recv_counts.view(ep, local)
    src_start = _exclusive_cumsum(by_rank.reshape(-1)).view(ep, local).t().reshape(-1)
    seg_counts = by_rank.t().reshape(-1)
    seg_start = _exclusive_cumsum(seg_counts)
    seg = torch.repeat_interleave(torch.arange(seg_counts.numel(), device=x.device), seg_counts, output_size=n)
    order = src_start[seg] + torch.arange(n, device=x.device) - seg_start[seg]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(n, device=x.device)
    return received[order], by_rank.sum(0), _Route(send, recv, order, inverse)


def combine(y: torch.Tensor, route: _Route, group: dist.ProcessGroup) -> torch.Tensor:
    """The experts' outputs back to the ranks (and rows) their tokens came from."""
    return all_to_all_single_autograd(y[route.inverse], route.send, route.recv, group)


class ExpertParallel(ParallelStyle):
    """EP (``mesh`` 1-D ``ep``) or EP x ETP (``mesh`` 2-D ``("ep", "etp")``) on the routed experts.

    Under ETP the experts' input is replicated over the TP ranks and each computes a partial sum
    of the output over its hidden slice: the MoE layer's output is then reduced over TP by the
    layer's own Partial -> Shard(1) output layout (the TP plan), and the input's gradient, partial
    in the same way, is summed over TP here."""

    def __init__(self) -> None:
        super().__init__()
        self._routes: list[_Route] = []

    @staticmethod
    def _meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
        if mesh.ndim == 1:
            return mesh, None
        return mesh["ep"], mesh["etp"]

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _, etp = self._meshes(mesh)
        for pname, param in list(module.named_parameters(recurse=False)):
            placements = [Shard(0)] if etp is None else [Shard(0), _tp_placement(pname)]
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, placements)))
        if etp is not None:
            _split_down_bias(module, etp.size())

    def _dispatch(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[torch.Tensor, ...]:
        x, counts = inputs
        ep, etp = self._meshes(mesh)
        if etp is not None:
            # Replicated over TP forward; summed over TP backward (each rank's grad is partial).
            x = DTensor.from_local(x, etp, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))
        load = getattr(module, "simulated_load", 1.0)
        local_x, local_counts, route = dispatch(x, counts, ep.get_group(), ep.size(), load)
        self._routes.append(route)
        # An expert's gradient sums the tokens of all EP ranks, and its FSDP (over efsdp = the
        # data-parallel ranks / EP) averages over ep times fewer ranks than the dense FSDP does:
        # the experts' weight gradients are scaled by 1 / ep (their outputs' gradient here, undone
        # for their inputs' gradient in _combine). A scaling in the backward pass rather than
        # FSDP's divide factor: that one needs a PREMUL_SUM reduction, which gloo does not have.
        return _ScaleGrad.apply(local_x, float(ep.size())), local_counts

    def _combine(self, module: nn.Module, y: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ep, _ = self._meshes(mesh)
        return combine(_ScaleGrad.apply(y, 1.0 / ep.size()), self._routes.pop(), ep.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition,
            input_fn=self._dispatch,  # pyright: ignore[reportArgumentType]
            output_fn=self._combine,  # pyright: ignore[reportArgumentType]
        )


class ExpertTensorParallel(ParallelStyle):
    """Routed experts under TP without EP: every TP rank holds every expert's hidden slice (as
    ETP); input replicated (gradient summed over TP), output partial (reduced by the layer's TP
    output layout)."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [_tp_placement(pname)])))
        _split_down_bias(module, mesh.size())

    @staticmethod
    def _input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[torch.Tensor, ...]:
        x, counts = inputs
        x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))
        return x, counts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition,
            input_fn=self._input,  # pyright: ignore[reportArgumentType]
        )


class NoParallel(ParallelStyle):
    """A module computed whole on every TP rank (a router): its parameters become Replicate
    DTensors (so grad clipping and foreach optimizers see one kind of parameter beside the TP
    ones), plain tensors in and out."""

    @staticmethod
    def _input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(t, mesh, (Replicate(),), run_check=False) if isinstance(t, torch.Tensor) else t
            for t in inputs
        )

    @staticmethod
    def _output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Said on the module for the memory estimate: its activations are whole on every TP rank.
        setattr(module, "computed_whole_over_tp", True)  # noqa: B010 (nn.Module's __setattr__ types)
        return distribute_module(
            module,
            device_mesh,
            input_fn=self._input,  # pyright: ignore[reportArgumentType]
            output_fn=self._output,  # pyright: ignore[reportArgumentType]
        )


def experts_shard_dim(shape: Sequence[int], efsdp: int, ep: int, num_experts: int) -> int:
    """The dim FSDP shards an expert weight of this rank's ``shape`` on: dim 0 (experts) while the
    FSDP x EP ranks do not outnumber the experts; beyond, the first other dim that ``efsdp`` divides
    (FSDP2 shards dims > 0 only evenly: gpt-oss 120b's 2880 splits over 64 ranks, not 128); with
    none, dim 0 again, padded to a whole expert per rank (memory that no longer shrinks)."""
    if efsdp * ep <= num_experts:
        return 0
    return next((d for d in range(1, len(shape)) if shape[d] % efsdp == 0), 0)


def apply_experts_fsdp(experts: nn.Module, mesh: DeviceMesh, num_experts: int, ep: int, **fsdp_kwargs: Any) -> None:
    """FSDP the routed experts over ``mesh`` on their own: the block's FSDP must not take them. Under
    EP (``ep`` > 1, the experts already EP-sharded) ``mesh`` is efsdp, or (dp_replicate, efsdp) for
    HSDP; without EP the dense FSDP mesh. With more FSDP x EP ranks than experts, dim 0 has too few
    rows to shard: another dim is sharded (experts_shard_dim)."""
    efsdp = mesh.size(mesh.ndim - 1)

    def placement(param: nn.Parameter) -> Shard:
        return Shard(experts_shard_dim(param.shape, efsdp, ep, num_experts))

    fully_shard(experts, mesh=mesh, shard_placement_fn=placement, **fsdp_kwargs)


def log_experts_layout(ep: int, etp: int, efsdp: int) -> None:
    logger.info(f"applied expert parallel (EP {ep}, ETP {etp}, experts' FSDP {efsdp})")
