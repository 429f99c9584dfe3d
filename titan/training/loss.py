"""Token-level cross entropy, summed, so the caller can normalise by the global token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the per-token losses in float32; labels == IGNORE_INDEX don't count.

    Normalising by the tokens of the whole global batch (not per rank or per micro-batch) keeps
    the loss and gradients identical for any data-parallel layout and accumulation split.
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
