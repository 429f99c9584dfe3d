"""Where every rank's shard of a matrix parameter lies, from DTensor metadata alone.

A sharded parameter's local tensor is one box of the global tensor (what DCP saves it as), at the
offset torch computes for any placement and mesh coordinate, strided shards included. Only the
mesh dims that shard the parameter take part (its sharding group; Replicate dims are replicas
doing the same work). Along each tensor dim the box depends only on the coordinates of the mesh
dims sharding that dim, so a ``Tiling`` keeps, per tensor dim, one span per such sub-coordinate:
at most the group's size in all, shared by every parameter of the same shape and placements, and
any rank's box is read from it without communication, tensor data or host reads (the plan of a
4,096-rank job is built the same way in a fake process group).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

__all__ = ["Box", "Layout", "Tiling", "LayoutBuilder", "local", "fsdp_layout"]

Box = tuple[tuple[int, int], ...]
"""(start, length) per tensor dim."""


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own elements: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class Tiling:
    """The boxes of one (shape, mesh, placements) over its sharding group; group rank = the
    row-major index of the coordinate over the sharding dims (mesh order)."""

    shape: tuple[int, ...]
    sizes: tuple[int, ...]
    """Sizes of the sharding mesh dims."""
    axes: tuple[tuple[int, ...], ...]
    """Per tensor dim: the sharding dims (indices into ``sizes``) that split it."""
    spans: tuple[dict[tuple[int, ...], tuple[int, int]], ...]
    """Per tensor dim: sub-coordinate on its axes -> (start, length)."""

    @property
    def ranks(self) -> int:
        return math.prod(self.sizes)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.sizes):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank_of(self, coordinate: Sequence[int]) -> int:
        rank = 0
        for c, size in zip(coordinate, self.sizes):
            rank = rank * size + c
        return rank

    def box(self, rank: int) -> Box:
        coord = self.coordinate(rank)
        return tuple(spans[tuple(coord[a] for a in axes)] for axes, spans in zip(self.axes, self.spans))

    def holders(self, dim_choices: Sequence[Sequence[tuple[int, ...]]]) -> list[tuple[int, Box]]:
        """(rank, box) of the ranks whose sub-coordinate on each tensor dim is one of
        ``dim_choices[dim]``, ranks ascending."""
        strides = [math.prod(self.sizes[a + 1 :]) for a in range(len(self.sizes))]
        per_dim = [
            [(sum(c * strides[a] for a, c in zip(axes, sub)), spans[sub]) for sub in choices]
            for axes, spans, choices in zip(self.axes, self.spans, dim_choices)
        ]
        out = [(sum(r for r, _ in combo), tuple(span for _, span in combo)) for combo in itertools.product(*per_dim)]
        out.sort()
        return out

    def nonempty(self, dim: int) -> list[tuple[int, ...]]:
        return [sub for sub, (_, n) in self.spans[dim].items() if n]


def _take(pieces: list[range], lo: int, hi: int) -> list[range]:
    """Elements [lo, hi) of the concatenation of ``pieces``."""
    out, at = [], 0
    for r in pieces:
        a, b = max(lo - at, 0), min(hi - at, len(r))
        if a < b:
            out.append(r[a:b])
        at += len(r)
    return out


def _chunk(pieces: list[range], parts: int, index: int) -> list[range]:
    """torch.chunk's ``index``-th of ``parts`` chunks (ceil-sized, trailing ones short or empty)."""
    total = sum(len(r) for r in pieces)
    size = -(-total // parts)
    lo, hi = min(index * size, total), min((index + 1) * size, total)
    return [pieces[0][lo:hi]] if len(pieces) == 1 else _take(pieces, lo, hi)


def _span(length: int, steps: list[tuple[Placement, int, int]]) -> tuple[int, int] | None:
    """(start, length) of the indices a rank holds along one tensor dim, given the (placement, mesh
    size, coordinate) of each mesh dim sharding it in mesh order; None where they are not one run.
    Shard takes a chunk; _StridedShard(split_factor f) takes that chunk of each of f chunks (DTensor's
    placement semantics, as torch's _compute_local_shape_and_global_offset applies them)."""
    pieces = [range(length)]
    for placement, parts, coord in steps:
        factor = getattr(placement, "split_factor", None)
        if factor is None:
            pieces = _chunk(pieces, parts, coord)
        else:
            pieces = [r for i in range(factor) for r in _chunk(_chunk(pieces, factor, i), parts, coord)]
    pieces = [r for r in pieces if len(r)]
    if not pieces:
        return 0, 0
    if any(x.stop != y.start for x, y in zip(pieces, pieces[1:])):
        return None
    return pieces[0].start, sum(len(r) for r in pieces)


def build_tiling(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: Sequence[Placement]) -> Tiling:
    """The tiling of ``shape`` placed by ``placements`` on a mesh of ``mesh_shape``; raises where a
    shard is not one box (a strided shard that interleaves rows). Spans are computed on index
    ranges (one Python walk per sub-coordinate) and checked against torch's own offsets at the
    first and last coordinates."""
    dims = _sharding_dims(mesh_shape, placements)
    axes = tuple(
        tuple(i for i, d in enumerate(dims) if getattr(placements[d], "dim", None) == t) for t in range(len(shape))
    )
    spans = []
    for t, on in enumerate(axes):
        table: dict[tuple[int, ...], tuple[int, int]] = {}
        for sub in itertools.product(*(range(mesh_shape[dims[a]]) for a in on)):
            span = _span(shape[t], [(placements[dims[a]], mesh_shape[dims[a]], c) for a, c in zip(on, sub)])
            if span is None:
                raise _not_boxes(shape, t, placements)
            table[sub] = span
        _check_tiles(shape, t, table, placements)
        spans.append(table)
    tiling = Tiling(tuple(shape), tuple(mesh_shape[d] for d in dims), axes, tuple(spans))
    for rank in {0, tiling.ranks - 1}:
        coord = [0] * len(mesh_shape)
        for d, c in zip(dims, tiling.coordinate(rank)):
            coord[d] = c
        # torch computes strided shards' offsets with small index tensors: real ones, also when
        # the plan is built inside a fake-tensor mode (the simulator's).
        with unset_fake_temporarily():
            size, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
        box = tiling.box(rank)
        if any(n != b[1] or (n and o != b[0]) for n, o, b in zip(size, offset, box)):
            raise ValueError(f"shards of {shape} placed {tuple(placements)} disagree with DTensor's: {box} at {coord}")
    return tiling


def _sharding_dims(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> list[int]:
    """The mesh dims that split a tensor placed so (a dim of size 1 splits nothing)."""
    return [d for d, pl in enumerate(placements) if not isinstance(pl, Replicate) and mesh_shape[d] > 1]


def _not_boxes(shape: tuple[int, ...], dim: int, placements: Sequence[Placement]) -> ValueError:
    return ValueError(
        f"whole-matrix updates need each shard to be one box of the parameter; shape {shape} placed"
        f" {tuple(placements)} is not tiled by boxes along dim {dim}"
    )


def _check_tiles(shape: tuple[int, ...], dim: int, table: dict, placements: Sequence[Placement]) -> None:
    end = 0
    for start, n in sorted(span for span in table.values() if span[1]):
        end = end + n if start == end else -1
    if end != shape[dim]:
        raise _not_boxes(shape, dim, placements)


@dataclass(frozen=True)
class Layout:
    """One matrix parameter ([A, B] or a stack [E, A, B]) as this rank sees it."""

    shape: tuple[int, ...]
    tiling: Tiling | None
    """None: whole on every rank (a plain tensor, or replicated on every mesh dim)."""
    me: int
    """This rank's index in the sharding group (0 without one)."""
    key: Hashable
    """The same for parameters sharded over the same ranks in the same order: their owners are
    balanced together."""
    group: dist.ProcessGroup | None = None


def fsdp_layout(shape: tuple[int, ...], shards: int, rank: int, tilings: dict) -> Layout:
    """The layout FSDP's dim-0 sharding over ``shards`` ranks gives (the memory estimate's model)."""
    if shards == 1:
        return Layout(tuple(shape), None, 0, None)
    key = (tuple(shape), (shards,), (Shard(0),))
    if key not in tilings:
        tilings[key] = build_tiling(tuple(shape), (shards,), (Shard(0),))
    return Layout(tuple(shape), tilings[key], rank, ("fsdp", shards))


class LayoutBuilder:
    """Layouts of DTensor parameters; tilings and process groups shared by the parameters that
    have the same ones."""

    def __init__(self) -> None:
        self._tilings: dict[Hashable, Tiling] = {}
        self._groups: dict[tuple[int, tuple[str, ...]], dist.ProcessGroup] = {}

    def _group(self, mesh: DeviceMesh, dims: tuple[int, ...]) -> dist.ProcessGroup:
        if len(dims) == 1:
            return mesh.get_group(dims[0])
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError("whole-matrix updates over several mesh dims need named mesh dims")
        key = (id(mesh), tuple(names[d] for d in dims))
        if key not in self._groups:
            self._groups[key] = mesh[key[1]]._flatten("_".join(key[1]) + "_whole_matrix").get_group()
        return self._groups[key]

    def layout(self, p: torch.Tensor) -> Layout:
        with unset_fake_temporarily():  # metadata only (mesh tensors are real), also in a fake-tensor mode
            return self._layout(p)

    def _layout(self, p: torch.Tensor) -> Layout:
        if p.ndim not in (2, 3):
            raise ValueError(f"whole-matrix updates take 2-D or 3-D [E, A, B] parameters, got shape {tuple(p.shape)}")
        shape = tuple(p.shape)
        if not isinstance(p, DTensor):
            return Layout(shape, None, 0, None)
        mesh, placements = p.device_mesh, tuple(p.placements)
        dims = tuple(_sharding_dims(mesh.shape, placements))
        if not dims:
            return Layout(shape, None, 0, None)
        key = (shape, tuple(mesh.shape), placements)
        if key not in self._tilings:
            self._tilings[key] = build_tiling(shape, tuple(mesh.shape), placements)
        tiling = self._tilings[key]
        group = self._group(mesh, dims)
        coord = mesh.get_coordinate()
        assert coord is not None, "a parameter's mesh holds this rank"
        me = tiling.rank_of([coord[d] for d in dims])
        if me != dist.get_rank(group):
            raise ValueError(
                f"mesh dims {dims} order ranks unlike their process group ({me} vs {dist.get_rank(group)})"
            )
        return Layout(shape, tiling, me, tuple(dist.get_process_group_ranks(group)), group)
