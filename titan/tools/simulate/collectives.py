"""The collectives of one step on one rank: kind, count, bytes this rank sends, and the mesh dim.

``CollectiveTracker`` is a dispatch mode over the c10d ops (the process-group calls FSDP, pipeline
send/recv and DCP issue) and the functional collectives (DTensor's redistributions, expert
parallelism's all-to-all). Under the fake process group nothing travels, but every call happens
with its real shapes, so the record is the rank's. Bytes sent per rank are what a ring algorithm
puts on the wire from this rank (the usual NCCL accounting): all-gather (n - 1) x the input,
reduce-scatter and all-reduce (n - 1) / n x the input (x 2 for all-reduce), all-to-all the input
minus the chunk kept, send and broadcast the tensor, receive nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CollectiveTracker", "group_labels"]

_c10d = torch.ops.c10d
_f = torch.ops._c10d_functional
_fa = torch.ops._c10d_functional_autograd

# op -> (kind, index of the process group argument, index of the tensor(s) whose bytes are sent)
_OPS: dict[Any, tuple[str, int, int]] = {
    _c10d._allgather_base_.default: ("all_gather", 2, 1),
    _c10d.allgather_.default: ("all_gather", 2, 1),
    _c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 2, 1),
    _f.all_gather_into_tensor.default: ("all_gather", 2, 0),
    _f.all_gather_into_tensor_out.default: ("all_gather", 2, 0),
    _f.all_gather_into_tensor_coalesced.default: ("all_gather", 2, 0),
    _fa.all_gather_into_tensor.default: ("all_gather", 2, 0),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 2, 1),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 2, 1),
    _c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 2, 1),
    _f.reduce_scatter_tensor.default: ("reduce_scatter", 3, 0),
    _f.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", 3, 0),
    _fa.reduce_scatter_tensor.default: ("reduce_scatter", 3, 0),
    _c10d.allreduce_.default: ("all_reduce", 1, 0),
    _c10d.allreduce_coalesced_.default: ("all_reduce", 1, 0),
    _f.all_reduce.default: ("all_reduce", 2, 0),
    _f.all_reduce_.default: ("all_reduce", 2, 0),
    _f.all_reduce_coalesced.default: ("all_reduce", 2, 0),
    _f.all_reduce_coalesced_.default: ("all_reduce", 2, 0),
    _c10d.alltoall_base_.default: ("all_to_all", 2, 1),
    _c10d.alltoall_.default: ("all_to_all", 2, 1),
    _f.all_to_all_single.default: ("all_to_all", 3, 0),
    _fa.all_to_all_single.default: ("all_to_all", 3, 0),
    torch.ops._dtensor.shard_dim_alltoall.default: ("all_to_all", 3, 0),
    _c10d.broadcast_.default: ("broadcast", 1, 0),
    _f.broadcast.default: ("broadcast", 2, 0),
    _f.broadcast_.default: ("broadcast", 2, 0),
    _c10d.send.default: ("send", 1, 0),
    _c10d.recv_.default: ("recv", 1, 0),
    _c10d.barrier.default: ("barrier", 1, -1),
}
# all-to-all ops with per-rank input split sizes: the index of that argument
_ALL_TO_ALL_SPLITS = {
    _f.all_to_all_single.default: 2,
    _fa.all_to_all_single.default: 2,
    _c10d.alltoall_base_.default: 4,
}


def _group(arg: Any) -> dist.ProcessGroup:
    if isinstance(arg, str):  # functional collectives name their group
        from torch._C._distributed_c10d import _resolve_process_group

        return _resolve_process_group(arg)  # pyright: ignore[reportArgumentType]  # a GroupName is a str
    return dist.ProcessGroup.unbox(arg)


def _nbytes(obj: Any) -> int:
    total = 0
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def _sent(kind: str, func: Any, args: tuple, n: int, me: int) -> float:
    """Bytes this rank puts on the wire (ring algorithms)."""
    _, _, index = _OPS[func]
    b = _nbytes(args[index]) if index >= 0 else 0
    if kind == "all_gather":
        return b * (n - 1)
    if kind == "reduce_scatter":
        return b * (n - 1) / n
    if kind == "all_reduce":
        return 2 * b * (n - 1) / n
    if kind == "all_to_all":
        at = _ALL_TO_ALL_SPLITS.get(func)
        splits = args[at] if at is not None else None
        if splits:  # input split sizes: rows to each rank; the own chunk stays
            rows = args[index].shape[0]
            return b * (rows - splits[me]) / max(rows, 1)
        return b * (n - 1) / n
    if kind in ("send", "broadcast"):
        return b
    return 0.0


def group_labels(named: Mapping[str, dist.ProcessGroup | None]) -> dict[str, str]:
    """{process group name: label} from {label: group}; the first label of a group wins."""
    out: dict[str, str] = {}
    for label, pg in named.items():
        if pg is not None:
            out.setdefault(pg.group_name, label)
    return out


class CollectiveTracker(TorchDispatchMode):
    """Counts and bytes per (kind, group label) while active and ``counting``."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        super().__init__()
        self.labels = dict(labels)
        self.counting = False
        self.calls: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        spec = _OPS.get(func)
        if spec is not None and self.counting:
            kind, group_index, _ = spec
            pg = _group(args[group_index])
            n, me = pg.size(), pg.rank()
            label = self.labels.get(pg.group_name, f"group of {n}")
            record = self.calls[(kind, label)]
            record[0] += 1
            record[1] += _sent(kind, func, args, n, me)
        return out

    def by_kind(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for (kind, _), (count, sent) in sorted(self.calls.items()):
            entry = out.setdefault(kind, {"count": 0, "bytes": 0})
            entry["count"] += count
            entry["bytes"] += sent
        return out
