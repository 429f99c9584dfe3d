"""Whole-matrix updates for sharded parameters: a function applied to every whole matrix of a set
of parameters, each matrix on one rank, the results sent back as the same shards.

Orthogonalising optimizers (Muon) need the whole momentum matrix: Newton-Schulz on an FSDP row
shard or a TP column slice is a different optimizer. A parameter here is a plain tensor or a
DTensor with any placements whose shards are boxes (FSDP, TP rows or columns, FSDP x TP's strided
shards, the experts' EP x FSDP x ETP, HSDP's replicas), 2-D (one matrix) or 3-D [E, A, B] (E).
Who does what is planned once from metadata (titan.parallel.muon_plan); a step then runs the
buckets in turn: this rank's pieces of the bucket's travelling matrices go out in one
all_to_all (bfloat16: the function's input precision), every owner orthogonalises its matrices
and the local ones (same-shape matrices stacked, one batched call per stack), the results come
back in one all_to_all, and ``apply`` receives each piece. Collectives per step: two per bucket
with travelling matrices. Nothing on a rank is the size of a matrix it does not own: its own
pieces, the matrices it owns (received into place where the shards are row or column blocks),
stacks bounded by the memory budget, and update temporaries of at most ``CHUNK`` elements.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan.parallel.muon_layout import Box, Layout, LayoutBuilder
from titan.parallel.muon_pieces import CHUNK, in_place, regions, temp_bytes
from titan.parallel.muon_plan import (
    Bucket,
    Exchange,
    Route,
    Unit,
    exchange,
    frame,
    numel,
    plan_buckets,
    plan_units,
    routes,
)

__all__ = ["WholeMatrixUpdates", "Footprint", "CHUNK"]

_BF16 = 2

Update = Callable[[int, tuple, torch.Tensor], bool]
Apply = Callable[[int, tuple, torch.Tensor], None]
Orthogonalise = Callable[[torch.Tensor, int], None]


@dataclass(frozen=True)
class Footprint:
    """One rank's bytes in one bucket: its pieces (sent, then received back), the matrices it owns
    (received), the most its compute holds on top of those, and its largest fp32 update or apply
    temporary."""

    send: int = 0
    recv: int = 0
    work: int = 0
    temp: int = 0

    @property
    def transit(self) -> int:
        """Held while its pieces are packed, travel and are applied."""
        return self.send + self.recv + self.temp

    @property
    def busy(self) -> int:
        """Held while it computes (its pieces' send buffer is free by then)."""
        return self.recv + max(self.work, self.send)


class WholeMatrixUpdates:
    """Plans (at construction) and runs (``run``) the whole-matrix updates of ``params``.

    ``flops``: the function's cost per matrix of each parameter (owners are balanced by it);
    ``styles``: parameters with the same style may share one batched call; ``workspace(k, a, b)``:
    the function's temporary bytes on a [k, a, b] stack; ``budget``: bytes this may hold at once,
    by default three quarters of one more tensor like the parameters' shards (on the average
    shard, so that every rank plans alike; the last quarter is slack for the allocator); buckets,
    stacks and overlap are sized by it: ``share``, default budget / 4, is each rank's part of a
    bucket and the most a stack holds. ``layouts``: given instead of read from
    the parameters (a plan for a layout the parameters do not have: the memory estimate).
    ``loads``: FLOPs per group rank given out by the plans of other model parts on the same ranks
    (pipeline stages of one rank), so that their owners balance together; updated here.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        flops: Sequence[int],
        styles: Sequence[int],
        workspace: Callable[[int, int, int], int],
        budget: int | None = None,
        share: int | None = None,
        layouts: Sequence[Layout] | None = None,
        loads: dict[Hashable, list[int]] | None = None,
    ) -> None:
        builder = LayoutBuilder()
        self.layouts = list(layouts) if layouts is not None else [builder.layout(p) for p in params]
        self.styles, self.workspace = list(styles), workspace
        if budget is None:
            budget = (
                3
                * sum(
                    p.element_size() * p.numel() // (lay.tiling.ranks if lay.tiling is not None else 1)
                    for p, lay in zip(params, self.layouts)
                )
                // 4
            )
        self.budget = budget
        self.share = max(1, share if share is not None else budget // 4)

        def size(u: Unit) -> int:
            _, a, b = frame(self.layouts[u.param])
            return _BF16 * u.count * a * b

        def sent(u: Unit) -> int:  # the largest piece of it a rank sends
            lay = self.layouts[u.param]
            if not u.travels or lay.tiling is None:
                return 0
            rows, cols = (max(n for _, n in lay.tiling.spans[d].values()) for d in (-2, -1))
            return _BF16 * u.count * rows * cols

        cap = [max(1, self.share // (_BF16 * a * b)) for _, a, b in map(frame, self.layouts)]
        units, self.loads = plan_units(self.layouts, flops, cap, loads)
        self.buckets = plan_buckets(units, size, sent, flops, self.share)
        self._starts = [lay.tiling.box(lay.me)[0][0] if lay.tiling is not None else 0 for lay in self.layouts]
        self.mine: list[Exchange] = []
        self._most: list[tuple[int, int]] = []  # per bucket: largest (send + received, received + compute or send)
        for bucket in self.buckets:  # one walk over each bucket's pieces: this rank's part, every rank's bytes
            found = routes(bucket, self.layouts)
            lay = self.layouts[bucket.units[0].param]
            self.mine.append(exchange(bucket, found, lay.tiling.ranks if lay.tiling is not None else 1, lay.me))
            fp = self._footprints(bucket, found).values()
            self._most.append((max((f.transit for f in fp), default=0), max((f.busy for f in fp), default=0)))
        for i, bucket in enumerate(self.buckets[:-1]):  # ahead where two buckets' bound fits
            before = self._most[i - 1][0] if i and self.buckets[i - 1].ahead else 0
            (transit, busy), (nxt_transit, nxt_busy) = self._most[i], self._most[i + 1]
            bucket.ahead = before + busy + nxt_transit <= self.budget and transit + nxt_busy <= self.budget
        self.calls_per_step = 2 * sum(b.travels for b in self.buckets)

    # ------------------------------------------------------------------ memory
    def footprints(self, bucket: Bucket) -> dict[int, Footprint]:
        """Every group rank's bytes in ``bucket``."""
        return self._footprints(bucket, routes(bucket, self.layouts))

    def _footprints(self, bucket: Bucket, found: list[Route]) -> dict[int, Footprint]:
        send: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        owned: dict[int, list[Route]] = defaultdict(list)
        for route in found:
            owned[route[0].owner].append(route)
            for rank, box in route[1]:
                n = numel(box)
                send[rank] += n
                recv[route[0].owner] += n
        locals_: dict[int, list[Unit]] = defaultdict(list)
        for u in bucket.units:
            if not u.travels:
                locals_[u.owner].append(u)
        ranks = set(send) | set(owned) | set(locals_)
        temp: dict[int, int] = defaultdict(int)
        for route in found:
            for rank, (_, (_, a), (_, b)) in route[1]:
                temp[rank] = max(temp[rank], temp_bytes(a, b))
        return {
            r: Footprint(_BF16 * send[r], _BF16 * recv[r], self._work(owned[r], locals_[r]), temp[r]) for r in ranks
        }

    def _work(self, owned: list[Route], locals_: list[Unit]) -> int:
        """The most a rank's compute in a bucket holds beyond its received buffer."""
        work = 0
        if len(owned) == 1 and owned[0][2] is not None:
            u, _, _, reorder = owned[0]
            _, a, b = frame(self.layouts[u.param])
            work = max(_BF16 * reorder, self.workspace(1, a, b))
        else:
            for chunk in self._chunks([route[0] for route in owned]):
                work = max(work, self._stack_bytes(chunk))
        for chunk in self._chunks(locals_):
            _, a, b = frame(self.layouts[chunk[0].param])
            k = sum(u.count for u in chunk)
            work = max(work, _BF16 * k * a * b + max(self.workspace(k, a, b), temp_bytes(a, b)))
        return work

    def _stack_bytes(self, chunk: list[Unit]) -> int:
        _, a, b = frame(self.layouts[chunk[0].param])
        k = sum(u.count for u in chunk)
        return _BF16 * k * a * b + self.workspace(k, a, b)

    def _chunks(self, units: list[Unit]) -> list[list[Unit]]:
        """Same-shape, same-style units stacked up to ``share`` bytes (one unit at least)."""
        groups: dict[tuple, list[Unit]] = {}
        for u in units:
            groups.setdefault((frame(self.layouts[u.param])[1:], self.styles[u.param]), []).append(u)
        out = []
        for same in groups.values():
            chunk: list[Unit] = []
            for u in same:
                if chunk and self._stack_bytes([*chunk, u]) > self.share:
                    out.append(chunk)
                    chunk = []
                chunk.append(u)
            out.append(chunk)
        return out

    def peak(self) -> int:
        """An upper bound of any rank's bytes at once over a step (each bucket's largest rank)."""
        peak, held = 0, 0  # held: a pending bucket's return buffers
        for i, bucket in enumerate(self.buckets):
            nxt = self._most[i + 1][0] if bucket.ahead and i + 1 < len(self.buckets) else 0
            peak = max(peak, held + self._most[i][1] + nxt, self._most[i][0])
            held = self._most[i][0] if bucket.ahead else 0
        return peak

    # ------------------------------------------------------------------ step
    def _local_index(self, u: Unit, j: int, rows: slice) -> tuple:
        if len(self.layouts[u.param].shape) == 2:
            return (rows, slice(None))
        return (u.first - self._starts[u.param] + j, rows, slice(None))

    def _fill(self, dst: torch.Tensor, u: Unit, k: int, a: int, b: int, update: Update) -> None:
        """``dst`` (a [k, a, b] view) <- the update of this rank's part of ``u``."""
        for j, rows in regions(k, a, b):
            if not update(u.param, self._local_index(u, j, rows), dst[j, rows]):
                dst[j, rows].zero_()

    def _give(self, src: torch.Tensor, u: Unit, k: int, a: int, b: int, apply: Apply) -> None:
        for j, rows in regions(k, a, b):
            apply(u.param, self._local_index(u, j, rows), src[j, rows])

    def _start(self, b: int, update: Update, device: torch.device) -> tuple | None:
        ex, bucket = self.mine[b], self.buckets[b]
        if not bucket.travels:
            return None
        send = torch.empty(sum(ex.send_splits), dtype=torch.bfloat16, device=device)
        offset = 0
        for u, box, transposed in ex.sends:
            k, a, c = box[0][1], box[1][1], box[2][1]
            piece = send[offset : offset + k * a * c]
            self._fill(piece.view(k, c, a).mT if transposed else piece.view(k, a, c), u, k, a, c, update)
            offset += k * a * c
        recv = send.new_empty(sum(ex.recv_splits))
        group = self.layouts[bucket.units[0].param].group
        work = dist.all_to_all_single(recv, send, ex.recv_splits, ex.send_splits, group=group, async_op=True)
        return send, recv, work

    def _orthogonalise_owned(self, ex: Exchange, recv: torch.Tensor, fn: Orthogonalise) -> None:
        if len(ex.recvs) == 1 and ex.recvs[0][2] is not None:
            u, pieces, way = ex.recvs[0]
            in_place(recv, u.param, frame(self.layouts[u.param])[1:], pieces, way == "cols", fn)
            return
        # The receive buffer holds, by source rank, that rank's pieces of the owned units in unit order.
        by_source: dict[int, list[tuple[Unit, Box]]] = {}
        for u, pieces, _ in ex.recvs:
            for src, box in pieces:
                by_source.setdefault(src, []).append((u, box))
        offsets, offset = {}, 0
        for src in sorted(by_source):
            for u, box in by_source[src]:
                offsets[(u, src)] = offset
                offset += numel(box)
        boxes = {u: pieces for u, pieces, _ in ex.recvs}
        for chunk in self._chunks(list(boxes)):
            _, a, b = frame(self.layouts[chunk[0].param])
            stack = recv.new_empty(sum(u.count for u in chunk), a, b)
            views, slot = [], 0
            for u in chunk:
                for src, box in boxes[u]:
                    (_, k), (r0, ra), (c0, cb) = box
                    got = recv[offsets[(u, src)] :][: k * ra * cb].view(k, ra, cb)
                    views.append((got, stack[slot : slot + k, r0 : r0 + ra, c0 : c0 + cb]))
                slot += u.count
            for got, place in views:
                place.copy_(got)
            fn(stack.mT if a > b else stack, chunk[0].param)
            for got, place in views:
                got.copy_(place)

    def _orthogonalise_local(
        self, ex: Exchange, update: Update, apply: Apply, fn: Orthogonalise, device: torch.device
    ) -> None:
        for chunk in self._chunks(ex.locals):
            _, a, b = frame(self.layouts[chunk[0].param])
            stack = torch.empty(sum(u.count for u in chunk), a, b, dtype=torch.bfloat16, device=device)
            slot = 0
            for u in chunk:
                self._fill(stack[slot : slot + u.count], u, u.count, a, b, update)
                slot += u.count
            fn(stack.mT if a > b else stack, chunk[0].param)
            slot = 0
            for u in chunk:
                self._give(stack[slot : slot + u.count], u, u.count, a, b, apply)
                slot += u.count

    def run(self, update: Update, orthogonalise: Orthogonalise, apply: Apply, device: torch.device) -> None:
        """One step. ``update(param, index, out)``: writes the update of ``index`` of the parameter's
        local shard into ``out`` (a bfloat16 view of the buffer it travels in, so no fp32 copy of
        it is made) and returns True, or False where it has no gradient (nothing is applied);
        ``orthogonalise(x, param)``: in place on a bfloat16 [k, rows, cols] stack with rows <= cols;
        ``apply(param, index, result)``."""
        n = len(self.buckets)
        out = self._start(0, update, device) if n else None
        pending = None
        for b in range(n):
            ex, current, out = self.mine[b], out, None
            recv = None
            if current is not None:
                send, recv, work = current
                work.wait()
                del send, current
            if self.buckets[b].ahead and b + 1 < n:
                out = self._start(b + 1, update, device)
            if recv is not None and ex.recvs:
                self._orthogonalise_owned(ex, recv, orthogonalise)
            self._orthogonalise_local(ex, update, apply, orthogonalise, device)
            back = None
            if recv is not None:
                ret = recv.new_empty(sum(ex.send_splits))
                group = self.layouts[self.buckets[b].units[0].param].group
                back = (ret, recv, dist.all_to_all_single(ret, recv, ex.send_splits, ex.recv_splits, group, True))
            if pending is not None:
                self._finish(*pending, apply)
            pending = (b, back)
            if not self.buckets[b].ahead:
                self._finish(*pending, apply)
                pending = None
                if b + 1 < n:
                    out = self._start(b + 1, update, device)
        if pending is not None:
            self._finish(*pending, apply)

    def _finish(self, b: int, back: tuple | None, apply: Apply) -> None:
        if back is None:
            return
        ret, _, work = back
        work.wait()
        offset = 0
        for u, box, transposed in self.mine[b].sends:
            k, a, c = box[0][1], box[1][1], box[2][1]
            piece = ret[offset : offset + k * a * c]
            self._give(piece.view(k, c, a).mT if transposed else piece.view(k, a, c), u, k, a, c, apply)
            offset += k * a * c
