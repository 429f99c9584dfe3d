"""QK-clip (MuonClip's, Kimi K2) and the largest attention logit as a logged metric.

During the forward every attention kernel keeps the largest pre-softmax logit of each of its heads
(titan.models.max_logits). After the optimizer step (a post-step hook registered before float8's
scale precompute, so those scales see the clipped weights) the per-layer, per-head maxima are
reduced over every rank in one all-reduce (MAX of a [layers, heads] table: data-parallel and
context-parallel ranks saw other tokens, tensor-parallel ranks other heads, pipeline stages other
layers), and with ``optimizer.qk_clip_threshold`` = tau each head whose maximum S exceeded tau gets
gamma = tau / S: the attention module rescales its query/key weights so that head's logits scale
by gamma (``qk_clip_scales``: per family, since what a logit depends on differs), on the local
shards, by rows. Nothing is read on the host: heads under tau are multiplied by exactly 1.

Tracking runs every step when clipping, and otherwise only on the log steps that show the metric
(``metrics.max_logit_freq``). On log steps the step's maximum over all layers and heads goes on the
console line (``max_logit``), with the number of heads clipped since the last log step
(``qk_clipped_heads``), and each layer's maximum goes to the metric files.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.models.llama.model import Attention
from titan.models.max_logits import RowScale
from titan.models.mtp import mtp_depth
from titan.parallel.dims import ParallelDims
from titan.training.metrics import FILES_ONLY_PREFIXES

__all__ = [
    "PER_LAYER_PREFIX",
    "QKClip",
    "attention_modules",
    "check_qk_clip",
    "clip_gammas",
    "local_rows",
    "rescale_",
]

PER_LAYER_PREFIX = FILES_ONLY_PREFIXES[1]
"""Per-layer maxima go to TensorBoard/W&B/JSONL, not to the console line."""


def check_qk_clip(config: JobConfig, dims: ParallelDims) -> None:
    """The layouts QK-clip cannot run (the run plan's check, before any process group)."""
    tau = config.optimizer.qk_clip_threshold
    if tau is None:
        return
    if dims.cp_enabled and config.model.attn_type != "flex":
        raise TitanError(
            f"optimizer.qk_clip_threshold with parallelism.context_parallel_degree = {dims.cp} needs"
            f' model.attn_type = "flex" (got {config.model.attn_type!r}): ring SDPA attention returns no logits'
            " and spreads each query's keys over the ranks"
        )
    if config.fault_tolerance.enable:
        raise TitanError(
            "optimizer.qk_clip_threshold cannot run with fault_tolerance.enable: each replica group would clip"
            " by the logits of its own tokens and the groups' weights would part; unset one of them"
        )


def attention_modules(parts: list[nn.Module]) -> list[Attention]:
    """Every attention module of the parts (titan's Attention and the families built on it)."""
    return [m for part in parts for m in part.modules() if isinstance(m, Attention)]


def clip_gammas(table: torch.Tensor, threshold: float) -> torch.Tensor:
    """tau / S where a finite maximum S exceeds tau, else 1 (a -inf row had no attention; a
    non-finite step is left to training.nonfinite)."""
    over = torch.isfinite(table) & (table > threshold)
    return torch.where(over, threshold / table, torch.ones_like(table))


def local_rows(param: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The indices (on ``device``) of the rows of ``param`` this rank holds: a DTensor's placements on
    its dim 0 (FSDP's and TP's shards, strided ones too), whole elsewhere; None for a plain tensor."""
    if not isinstance(param, DTensor):
        return None
    placements = [p if getattr(p, "dim", None) == 0 else Replicate() for p in param.placements]
    rows = torch.arange(param.shape[0], device=device)
    return distribute_tensor(rows, param.device_mesh, placements, src_data_rank=None).to_local()


@torch.no_grad()
def rescale_(part: RowScale, rows: torch.Tensor | None = None) -> None:
    """``(param + offset) * scale - offset`` by rows, on this rank's shard of the parameter (``rows``:
    its ``local_rows``, worked out here when not given). No communication: every rank has all of
    ``scale`` (a row vector, not the parameter)."""
    param, scale = part.param, part.scale
    if rows is None:
        rows = local_rows(param, scale.device)
    local = param.to_local() if isinstance(param, DTensor) else param
    if rows is not None:
        scale = scale[rows]
    scale = scale.to(local.device).view(-1, *([1] * (local.dim() - 1)))
    if part.offset:
        local.add_(part.offset).mul_(scale).sub_(part.offset)
    else:
        local.mul_(scale)


class QKClip:
    """The trainer's handle: ``track(step, log_step)`` before each step's forward, ``after_step``
    after each optimizer step (registered by the build), ``log_tensors()`` on log steps.
    ``metric_freq``: metrics.max_logit_freq (without a threshold, which log steps measure)."""

    def __init__(
        self,
        threshold: float | None,
        parts: list[nn.Module],
        dims: ParallelDims,
        device: torch.device,
        attn_type: str,
        metric_freq: int = 1,
    ) -> None:
        self.threshold = threshold
        self.metric_freq = metric_freq
        self.modules = attention_modules(parts)
        args = getattr(parts[0], "model_args", None)
        # SDPA under context parallelism is ring attention on sharded q/k/v: no logits to take
        # (check_qk_clip refuses clipping there; the metric is left out). Decided by the config and
        # the model alone, never by this rank's modules: the table's all-reduce takes every rank, and
        # a pipeline stage may hold no attention (Qwen3.5's linear-attention blocks, an embedding stage).
        self.enabled = args is not None and not (dims.cp_enabled and attn_type != "flex")
        self._tracking = False
        self._table: torch.Tensor | None = None
        self._clipped = torch.zeros((), dtype=torch.int64, device=device)
        self._rows: dict[int, torch.Tensor | None] = {}  # id(parameter) -> its local_rows
        # The job's world, not the default group's: a job may run on fewer processes than a group
        # that is already up (a one-process run inside a test's or a tool's larger group).
        self._world = dims.world_size
        if not self.enabled:
            return
        assert args is not None
        tp = dims.submesh("tp")
        tp_size, tp_rank = (1, 0) if tp is None else (tp.size(), tp.get_local_rank())
        self.shape = (args.n_layers + mtp_depth(args), args.n_heads)  # multi-token prediction's blocks last
        self.slots = []  # (layer, first column, module): this rank's heads in the table
        for m in self.modules:
            heads = m.n_heads // tp_size
            m.inner_attention.start_tracking(heads, device)
            self.slots.append((m.layer_id, tp_rank * heads, m))
        # The per-layer metrics: this rank's attention layers (a pipeline stage's own, as the MoE
        # statistics), their rows of the reduced table. Known without reading any tensor, so the
        # build also runs on fake tensors.
        self.layers = sorted({layer for layer, _, _ in self.slots})

    def track(self, step: int, log_step: bool) -> None:
        """Before the step's forward: track when clipping, or when this step logs the metric."""
        freq = self.metric_freq
        metric = log_step and freq > 0 and (step == 1 or step % freq == 0)
        self._tracking = self.enabled and (self.threshold is not None or metric)
        for m in self.modules:
            m.inner_attention.track_logits = self._tracking

    def after_step(self) -> None:
        """The optimizer post-step hook: reduce the step's maxima, clip, reset the buffers."""
        if not self._tracking:
            return
        table = torch.full(self.shape, -math.inf, device=self._clipped.device)
        for layer, col, m in self.slots:
            kernel = m.inner_attention
            table[layer, col : col + kernel.max_logits.numel()] = kernel.max_logits
            kernel.reset_max_logits()
        if self._world > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self._table = table
        if self.threshold is None:
            return
        gamma = clip_gammas(table, self.threshold)
        self._clipped += (gamma < 1).sum()
        for layer, _, m in self.slots:
            for part in m.qk_clip_scales(gamma[layer, : m.n_heads]):
                key = id(part.param)
                if key not in self._rows:  # fixed per parameter: worked out at its first clip
                    self._rows[key] = local_rows(part.param, table.device)
                rescale_(part, self._rows[key])

    def log_tensors(self) -> dict[str, torch.Tensor]:
        """Device scalars for this log step: the step's largest logit (before the clip), per layer
        for the files, and the heads clipped since the last log step."""
        if self._table is None:
            return {}
        table, self._table = self._table, None
        out = {"max_logit": table.max()}
        per_layer = table.amax(dim=1)
        for layer in self.layers:
            out[f"{PER_LAYER_PREFIX}layers.{layer}/max_logit"] = per_layer[layer]
        if self.threshold is not None:
            out["qk_clipped_heads"] = self._clipped.clone()
            self._clipped.zero_()
        return out
