"""How the profile's labels (titan/training/memory/profile.py, measured on the whole model) land in
one rank's categories under its layout, and how much each weighs there: the profile looks for a
window's highest moment with these weights, so the moment is the rank's, not the whole model's.

- tensor parallelism with sequence parallelism divides a block's own work and the embedding's
  output by TP (heads, hidden dims, sequence); a sub-layer's normed input is all-gathered over the
  sequence, whole (and float8's casts of it, and of a row-wise layer's gradient, which comes back
  gathered); a row-wise layer's output is a partial sum over the whole sequence; modules TP runs
  whole (a router, latent attention's down-projections) and an MoE layer's routing work on the
  gathered tokens, whole; the routed experts' hidden states are divided by the experts' TP; the
  loss by TP under loss parallel. Under TP the embedding's output is a reduce-scatter's
  (``communication``), and so is the experts' output under EP (the combining all-to-all's).
- under EP the routed experts' work scales with the load this rank's experts get (balanced: 1).
- gradients: a block's unsharded gradients scale from the whole block to the rank's slice of it
  (its FSDP units' unsharded elements; under EP its own experts only); under FSDP they live in the
  block's backward (``activations``) until its reduce-scatter, without FSDP they are the gradients.
  The embedding's: under TP torch's DTensor makes it over the whole vocabulary (its backward has no
  row-sharded strategy) before reduce-scattering it to the rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan.parallel.dims import ParallelDims
from titan.training.memory.layout import ROOT, RankModel
from titan.training.memory.profile import LABELS

__all__ = ["LabelMap", "label_map"]

_ACT = "activations"


@dataclass
class LabelMap:
    category: dict[str, str]  # label -> category
    factor: dict[str, float]  # label -> bytes on the rank per byte measured (grads: times grad_scale)
    grad_scale: dict[int, float]  # layer id -> its block's unsharded gradient here over the whole block's
    root_share: float  # the embedding's, final norm's and output's unsharded gradients here over the whole ones'
    root_scale: float  # the same for the embedding's backward (whole under TP)

    def weights(self, block: int | None) -> dict[str, float]:
        """Each label's weight in a window of ``block`` (None: outside the blocks)."""
        out = dict(self.factor)
        out["grads"] = self.grad_scale.get(block, 0.0) if block is not None else 0.0
        out["root_grads"] = self.root_scale
        return out

    def categories(self, labels: dict[str, int], block: int | None, categories: tuple[str, ...]) -> dict[str, float]:
        out = dict.fromkeys(categories, 0.0)
        weights = self.weights(block)
        for label in LABELS:
            out[self.category[label]] += labels[label] * weights[label]
        return out


def label_map(rank: RankModel, dims: ParallelDims, compute_itemsize: int, expert_load: float) -> LabelMap:
    tp = dims.tp
    expert_tp = tp if tp > 1 and (dims.ep == 1 or dims.etp > 1) else 1
    held = _ACT if dims.fsdp_enabled else "gradients"
    table = {
        "block": (_ACT, 1 / tp),
        "gathered": (_ACT, 1.0),
        "rowwise": (_ACT, 1.0),
        "whole": (_ACT, 1.0),
        "router": (_ACT, 1.0),
        "moe": (_ACT, 1.0),
        "experts": (_ACT, (expert_load if dims.ep > 1 else 1.0) / expert_tp),
        "routed_out": ("communication" if dims.ep > 1 else _ACT, 1.0),
        "grads": (held, 1.0),
        "root_grads": (held, 1.0),
        "embed": ("communication" if tp > 1 else _ACT, 1 / tp),
        "loss": ("loss", 1 / tp if dims.loss_parallel_enabled else 1.0),
    }
    grads = {k: sum(u.grad for u in us) for k, us in rank.units.items()}
    scale = {
        i: grads.get(rank.kind[i], 0) / (rank.numel[i] * compute_itemsize) if rank.numel.get(i) else 0.0
        for i in rank.blocks
    }
    root = rank.numel.get(ROOT, 0) * compute_itemsize
    share = grads.get(ROOT, 0) / root if root else 0.0
    return LabelMap(
        category={k: c for k, (c, _) in table.items()},
        factor={k: f for k, (_, f) in table.items()},
        grad_scale=scale,
        root_share=share,
        root_scale=1.0 if tp > 1 else share,
    )
