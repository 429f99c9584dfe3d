"""Pieces of whole-matrix updates (titan.parallel.muon): the row slices an update is computed in,
and the reorder that makes a received buffer one matrix."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from titan.parallel.muon_plan import numel, runs

__all__ = ["CHUNK", "temp_bytes", "regions", "in_place"]

CHUNK = 1 << 18
"""Elements of an update or apply temporary (fp32): rows are computed in slices of this size."""


def temp_bytes(a: int, b: int) -> int:
    """Bytes of the largest fp32 region of an [a, b] piece (see regions)."""
    return 4 * min(a, max(1, CHUNK // max(b, 1))) * b


def regions(k: int, a: int, b: int) -> Iterator[tuple[int, slice]]:
    """(matrix, row slice) covering [k, a, b] in pieces of at most CHUNK elements."""
    step = max(1, CHUNK // max(b, 1))
    for j in range(k):
        for r in range(0, a, step):
            yield j, slice(r, min(a, r + step))


def in_place(
    recv: torch.Tensor,
    param: int,
    shape: tuple[int, int],
    pieces: list,
    cols: bool,
    fn: Callable[[torch.Tensor, int], None],
) -> None:
    """The received pieces are the matrix's (its transpose's with ``cols``) row blocks, each split
    in consecutive pieces: join each split block into rows, orthogonalise, split it back."""
    rows, width = (shape[1], shape[0]) if cols else shape
    r, c = (2, 1) if cols else (1, 2)
    found = runs(pieces, width, cols)
    assert found is not None, "an in-place plan is made of row blocks"
    starts, offset = [], 0
    for _, box in pieces:
        starts.append(offset)
        offset += numel(box)
    split = [(starts[i], n, pieces[i][1][r][1], [pieces[j][1][c][1] for j in range(i, i + n)]) for i, n in found]

    def join(forward: bool) -> None:
        for start, n, height, widths in split:
            if n == 1:
                continue
            block = recv[start : start + height * width].view(height, width)
            parts, o = [], start
            for w in widths:
                parts.append(recv[o : o + height * w].view(height, w))
                o += height * w
            if forward:
                block.copy_(torch.cat(parts, dim=1))
            else:
                whole, col = block.clone(), 0
                for part, w in zip(parts, widths):
                    part.copy_(whole[:, col : col + w])
                    col += w

    join(True)
    matrix = recv.view(1, rows, width)
    fn(matrix.mT if rows > width else matrix, param)
    join(False)
