"""Who orthogonalises which matrix, which matrices travel together, and what each rank sends,
receives and holds: planning only, Python ints computed from the layouts (titan.parallel.muon_layout)
the same way on every rank, so that ranks agree without exchanging anything.

Units. A 2-D parameter is one matrix, a 3-D [E, A, B] parameter E of them. A matrix held whole by
one rank of its sharding group (an expert that expert parallelism, or FSDP on the expert dim, keeps
whole) stays there: a local unit, orthogonalised in place. Every other matrix travels: its shards
go to one owner and come back orthogonalised.

Owners. Within each set of ranks that shard parameters alike (one sharding group; replicas repeat
its decisions), every rank starts with the Newton-Schulz FLOPs of its local units; the travelling
matrices then go, largest first, to the rank with the fewest FLOPs so far (LPT), so each of N ranks
does about 1/N of the work whatever the mix of shapes.

Buckets. Each rank's units, largest first, are dealt out in rounds: a bucket takes from every rank
as many units as fit its share of the memory budget (at least one), so all owners of a bucket
work at the same time and no rank holds more than its share. A bucket's shards travel in one
all_to_all and come back in one: two collectives per bucket with travelling units, none for
local-only buckets. Where the budget holds two buckets at once, the next bucket's shards travel
while this bucket is orthogonalised (``ahead``).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from titan.parallel.muon_layout import Box, Layout

__all__ = ["Unit", "Bucket", "Exchange", "Route", "plan_units", "plan_buckets", "routes", "exchange", "frame", "numel"]


@dataclass(frozen=True, order=True)
class Unit:
    """Matrices [first, first + count) of parameter ``param`` (a 2-D parameter: 0, 1)."""

    param: int
    first: int
    count: int
    owner: int = field(compare=False)
    """The sharding-group rank that orthogonalises them."""
    travels: bool = field(compare=False)


@dataclass
class Bucket:
    key: Hashable
    units: list[Unit]
    """Sorted by (param, first): the order every rank packs and unpacks in."""
    ahead: bool = False
    """The next bucket's shards travel while this one is orthogonalised."""

    @property
    def travels(self) -> bool:
        return any(u.travels for u in self.units)


def frame(lay: Layout) -> tuple[int, int, int]:
    """(matrices, rows, columns) of a parameter."""
    if len(lay.shape) == 3:
        return lay.shape[0], lay.shape[1], lay.shape[2]
    return 1, lay.shape[0], lay.shape[1]


def _segments(lay: Layout) -> list[tuple[int, int, int]]:
    """(first matrix, count, how many ranks hold a part of each) of each run of matrices held by the
    same ranks; a 2-D parameter is one run."""
    t = lay.tiling
    matrices = frame(lay)[0]
    if t is None:
        return [(0, matrices, 1)]
    parts = len(t.nonempty(len(lay.shape) - 2)) * len(t.nonempty(len(lay.shape) - 1))
    if len(lay.shape) == 2:
        return [(0, 1, parts)]
    spans = [span for span in t.spans[0].values() if span[1]]
    cuts = sorted({0, matrices} | {s for s, _ in spans} | {s + n for s, n in spans})
    return [(a, b - a, parts * sum(s <= a and b <= s + n for s, n in spans)) for a, b in zip(cuts, cuts[1:])]


def holders(lay: Layout, unit: Unit) -> list[tuple[int, Box]]:
    """(rank, the box of the unit it holds: (matrices, rows, columns) spans), ranks ascending."""
    t = lay.tiling
    _, rows, cols = frame(lay)
    if t is None:
        return [(0, ((unit.first, unit.count), (0, rows), (0, cols)))]
    dims = len(lay.shape)
    choices = [t.nonempty(dims - 2), t.nonempty(dims - 1)]
    if dims == 3:
        choices.insert(0, [sub for sub, (s, n) in t.spans[0].items() if n and s <= unit.first < s + n])
    matrices = (unit.first, unit.count)
    return [(rank, (matrices, box[-2], box[-1])) for rank, box in t.holders(choices)]


def plan_units(
    layouts: Sequence[Layout],
    flops: Sequence[int],
    local_cap: Sequence[int],
    loads: dict[Hashable, list[int]] | None = None,
) -> tuple[dict[Hashable, list[Unit]], dict[Hashable, list[int]]]:
    """Units per sharding key and the NS FLOPs each group rank gets (``flops``: per matrix of each
    parameter; ``local_cap``: most matrices of a parameter in one local unit). ``loads``: the FLOPs
    already given to each group rank (other model parts on the same ranks), updated here."""
    units: dict[Hashable, list[Unit]] = defaultdict(list)
    loads = {} if loads is None else loads
    travelling: dict[Hashable, list[Unit]] = defaultdict(list)
    for i, lay in enumerate(layouts):
        size = lay.tiling.ranks if lay.tiling is not None else 1
        load = loads.setdefault(lay.key, [0] * size)
        for first, count, parts in _segments(lay):
            if parts == 1:  # whole on one rank: it stays there
                owner = holders(lay, Unit(i, first, count, 0, False))[0][0]
                for start in range(first, first + count, local_cap[i]):
                    n = min(local_cap[i], first + count - start)
                    units[lay.key].append(Unit(i, start, n, owner, False))
                    load[owner] += n * flops[i]
            else:
                travelling[lay.key] += [Unit(i, e, 1, -1, True) for e in range(first, first + count)]
    for key, todo in travelling.items():
        load = loads[key]
        heap = [(w, r) for r, w in enumerate(load)]
        heapq.heapify(heap)
        for u in sorted(todo, key=lambda u: (-flops[u.param], u.param, u.first)):
            w, r = heapq.heappop(heap)
            units[key].append(Unit(u.param, u.first, 1, r, True))
            load[r] = w + flops[u.param]
            heapq.heappush(heap, (load[r], r))
    return units, loads


def plan_buckets(
    units: dict[Hashable, list[Unit]],
    size: Callable[[Unit], int],
    sent: Callable[[Unit], int],
    flops: Sequence[int],
    share: int,
) -> list[Bucket]:
    """Deal each key's units out in rounds: each rank in turn adds its next largest units to the
    bucket while their ``size`` (bytes held by the owner) fits ``share`` (one at least), and the
    bucket closes when the ``sent`` bytes (the largest piece any rank sends) of its units would pass
    ``share``; the next bucket goes on from the next rank. Consecutive units of one parameter and
    owner merge."""
    buckets = []
    for key in sorted(units, key=lambda k: (k is not None, min(u.param for u in units[k]))):
        queues: dict[int, list[Unit]] = defaultdict(list)
        for u in sorted(units[key], key=lambda u: (-u.count * flops[u.param], u)):
            queues[u.owner].append(u)
        order = sorted(queues)
        position = dict.fromkeys(order, 0)
        turn, left = 0, sum(len(q) for q in queues.values())
        while left:
            bucket: list[Unit] = []
            sending = 0
            for _ in range(len(order)):
                r = order[turn]
                q, used = queues[r], 0
                while position[r] < len(q):
                    u = q[position[r]]
                    if bucket and (used + size(u) > share and used or sending + sent(u) > share):
                        break
                    used, sending = used + size(u), sending + sent(u)
                    bucket.append(u)
                    position[r] += 1
                    left -= 1
                if position[r] < len(q) and used == 0:
                    break  # the bucket is full: this rank starts the next one
                turn = (turn + 1) % len(order)
            buckets.append(Bucket(key, _merge(sorted(bucket))))
    return buckets


def _merge(units: list[Unit]) -> list[Unit]:
    out: list[Unit] = []
    for u in units:
        last = out[-1] if out else None
        if (
            last is not None
            and (last.param, last.owner, last.travels) == (u.param, u.owner, u.travels)
            and last.first + last.count == u.first
            and u.travels
        ):
            out[-1] = Unit(u.param, last.first, last.count + u.count, u.owner, True)
        else:
            out.append(u)
    return out


@dataclass
class Exchange:
    """One rank's part of a bucket."""

    sends: list[tuple[Unit, Box, bool]] = field(default_factory=list)
    """(unit, the box this rank holds, sent transposed), grouped by owner, in unit order."""
    send_splits: list[int] = field(default_factory=list)
    recvs: list[tuple[Unit, list[tuple[int, Box]], str | None]] = field(default_factory=list)
    """Owned travelling units: (unit, its (source rank, box) pieces by rank, in-place orientation)."""
    recv_splits: list[int] = field(default_factory=list)
    locals: list[Unit] = field(default_factory=list)


def numel(box: Box) -> int:
    return box[0][1] * box[1][1] * box[2][1]


def runs(pieces: list[tuple[int, Box]], width: int, transpose: bool) -> list[tuple[int, int]] | None:
    """(first piece, pieces) of each full-width row block of the matrix (of its transpose with
    ``transpose``) in receive order, or None where the pieces are not such blocks."""
    r, c = (2, 1) if transpose else (1, 2)
    out, i = [], 0
    while i < len(pieces):
        j, end = i, 0
        while j < len(pieces) and pieces[j][1][r] == pieces[i][1][r] and pieces[j][1][c][0] == end:
            end += pieces[j][1][c][1]
            j += 1
        if end != width:
            return None
        out.append((i, j - i))
        i = j
    return out


def orientation(pieces: list[tuple[int, Box]], shape: tuple[int, int], only: bool) -> tuple[str | None, int]:
    """How an owned matrix is received: in place ("rows": the receive buffer is the matrix with its
    row blocks permuted; "cols": the same for its transpose, shards sent transposed) or None
    (assembled by copies), and the elements of the buffer that reorders a block split over
    several pieces. Only a lone owned single matrix is received in place; the orientation with the
    smaller reorder buffer wins."""
    best: tuple[str | None, int] = (None, 0)
    if not only or pieces[0][1][0][1] != 1:
        return best
    for name, width, r in (("rows", shape[1], 1), ("cols", shape[0], 2)):
        found = runs(pieces, width, name == "cols")
        if found is not None:
            need = max((pieces[i][1][r][1] * width for i, n in found if n > 1), default=0)
            if best[0] is None or need < best[1]:
                best = (name, need)
    return best


Route = tuple[Unit, list[tuple[int, Box]], "str | None", int]
"""A travelling unit, its pieces (rank, box) by rank, how its owner receives it (orientation) and
the elements of that reorder buffer."""


def routes(bucket: Bucket, layouts: Sequence[Layout]) -> list[Route]:
    """The travelling units of ``bucket`` with their pieces: one walk over every holder."""
    owned: dict[int, int] = defaultdict(int)
    for u in bucket.units:
        owned[u.owner] += u.travels
    out = []
    for u in bucket.units:
        if u.travels:
            pieces = holders(layouts[u.param], u)
            out.append((u, pieces, *orientation(pieces, frame(layouts[u.param])[1:], owned[u.owner] == 1)))
    return out


def exchange(bucket: Bucket, found: list[Route], ranks: int, rank: int) -> Exchange:
    """``rank``'s part of ``bucket`` (a group of ``ranks``) given its routes."""
    ex = Exchange(locals=[u for u in bucket.units if not u.travels and u.owner == rank])
    ex.send_splits, ex.recv_splits = [0] * ranks, [0] * ranks
    for u, pieces, way, _ in found:
        if u.owner == rank:
            ex.recvs.append((u, pieces, way))
            for src, box in pieces:
                ex.recv_splits[src] += numel(box)
        for src, box in pieces:
            if src == rank:
                ex.sends.append((u, box, way == "cols"))
                ex.send_splits[u.owner] += numel(box)
    ex.sends.sort(key=lambda s: (s[0].owner, s[0]))
    return ex
