"""Token-level cross entropy, summed, so the caller can normalise by the global token count.

Training and evaluation use the one loss function (``cross_entropy_sum``, compiled when
``compile.components`` names the loss). The pipeline schedule calls it on each micro-batch through
``ScaledLoss``: the scale is passed in for each schedule call (training: data-parallel degree over
the step's global token count; evaluation: 1, a plain sum) and exists only for that call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the per-token losses in float32; labels == IGNORE_INDEX don't count.

    Normalising by the tokens of the whole global batch (not per rank or per micro-batch) keeps
    the loss and gradients identical for any data-parallel layout and accumulation split.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class ScaledLoss:
    """``loss_fn(logits, labels) * scale`` for a caller (the pipeline schedule) that cannot pass the
    scale itself: ``with scaled_loss.scale(s): schedule.step(...)``. Called outside such a block it
    raises instead of reusing an earlier call's scale."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self._scale: torch.Tensor | None = None

    @contextlib.contextmanager
    def scale(self, scale: torch.Tensor) -> Iterator[None]:
        self._scale = scale
        try:
            yield
        finally:
            self._scale = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError("ScaledLoss called outside a `with scale(...)` block: no scale was passed")
        return self.loss_fn(logits, labels) * self._scale
