"""Token-level cross entropy, summed, so the caller can normalise by the global token count.

``TokenLoss`` is the one place that turns the model's output and the labels into the summed
token loss times a scale, for training and evaluation, with and without the pipeline schedule
(which calls it through ``ScaledLoss``: the scale is passed in for each schedule call and exists
only for that call; training: data-parallel degree over the step's global token count,
evaluation: 1, a plain sum). Two paths behind that one call:

* ``training.loss_chunk_tokens = 0``: the model returns the logits [B, S, V] and the loss is
  ``cross_entropy_sum`` over all of them (compiled when ``compile.components`` names the loss).
* ``training.loss_chunk_tokens = C > 0``: the model part holding the output projection returns the
  normed hidden states [B, S, dim] instead (``loss_owns_output``, the rule in titan/models'
  ``ModelSpec``), and the loss calls the ``output`` module (so its TP and FSDP hooks run) and the
  cross entropy on C tokens at a time. In training each chunk's backward runs at once, inside the
  loss call, and the chunk's logits are freed before the next chunk: the hidden states' gradient
  is written chunk by chunk into one [B, S, dim] buffer and the output weight's gradient is
  summed over the chunks. The returned loss hands both to the model's backward (``_HiddenGrad``).
  Under FSDP (``output`` is its own FSDP unit) the weight's gradient goes through FSDP's hooks
  instead, gathered once and reduce-scattered after the last chunk; elsewhere it is handed over
  in the model's backward, so DDP's hooks fire once per step. Peak loss memory is about
  C x V x (bytes of the logits + 2 x 4 for the fp32 log-softmax and its gradient) instead of
  B x S x V x the same, plus B x S x dim for the hidden gradient. Tensor parallel: the hidden
  states are gathered over the sequence (dim wide, not vocab wide) and each rank computes its
  vocabulary shard of every chunk under loss parallel, as the full path does.

Why the eager per-chunk backward and not a recompute (torch.utils.checkpoint per chunk): the
recompute runs the output matmul a second time in backward, +1/3 of the output layer's FLOPs, and
at Llama 3's vocabulary with a small width the output layer is most of the step. The eager backward
costs no extra FLOPs; its price is that the scale (1 / global tokens) must be known before the
backward, which every caller has, and that under FSDP the returned loss must be backpropagated
with gradient 1 (``loss.backward()``, as the trainer and the pipeline schedule do: the output
weight's gradient was already taken at that scale).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from titan.config.job_config import JobConfig
from titan.models.mtp import mtp_depth

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


class _HiddenGrad(torch.autograd.Function):
    """Returns the (already computed) loss; its backward hands the precomputed gradients of the
    hidden states and of ``params``, times the incoming gradient, to the model's backward."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, grads: list[torch.Tensor], hidden: torch.Tensor, *params: torch.Tensor):
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        return None, None, *(g * grad_out.to(g.dtype) for g in grads)


def output_module(parts: list[nn.Module]) -> nn.Module | None:
    """The output projection among this rank's model parts (the last pipeline stage's), or None."""
    for part in parts:
        output = getattr(part, "output", None)
        if output is not None:
            return output
    return None


class TokenLoss:
    """``loss(out, labels, scale)`` = scale x the summed token loss (a plain tensor, or a replicated
    DTensor under loss parallel with the full logits).

    ``chunk_tokens`` 0: ``out`` are the logits. Otherwise ``out`` are the normed hidden states and
    ``bind(parts)`` must have found the output projection (the model parts must have been built
    with ``loss_owns_output``). ``ce``: the cross entropy of one logits block (the full logits or a
    chunk), e.g. ``cross_entropy_sum`` compiled.

    Multi-token prediction (``mtp_depth`` > 0, titan.models.mtp): ``out`` holds the main rows and
    then each depth's on the batch dim and ``labels`` are [B, 1 + depth, S] (``mtp_labels``). The
    backward pass gets scale x (main + ``mtp_weight`` x the mean over depths of each depth's sum);
    the returned value is the main loss alone (the MTP part enters as ``x - x.detach()``), so the
    logged and validated loss keeps its meaning, and carries the scaled MTP mean (detached) as its
    attribute ``mtp_loss``: a pipeline schedule keeps the loss tensors of its micro-batches, and
    only those (torch's first step also calls the loss on the uninitialized outputs of its shape
    inference). Plain [B, S] labels (evaluation) score the main rows only.
    """

    def __init__(
        self, chunk_tokens: int = 0, ce: LossFn = cross_entropy_sum, mtp_depth: int = 0, mtp_weight: float = 0.0
    ) -> None:
        self.chunk_tokens, self.ce = chunk_tokens, ce
        self.output: nn.Module | None = None
        self.mtp_depth, self.mtp_weight = mtp_depth, mtp_weight

    def bind(self, parts: list[nn.Module]) -> None:
        self.output = output_module(parts) if self.chunk_tokens > 0 else None

    def __call__(self, out: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        segments = list(labels.unbind(1)) if labels.dim() == 3 else [labels]
        if not torch.is_grad_enabled():
            segments = segments[:1]
        rows = labels.shape[0]
        if out.shape[0] != rows * len(segments):  # rows of MTP depths this call does not score
            out = out[: rows * len(segments)]
        weights = [1.0] + [self.mtp_weight / max(len(segments) - 1, 1)] * (len(segments) - 1)
        if self.chunk_tokens <= 0:
            losses = [self.ce(out[k * rows : (k + 1) * rows], y) for k, y in enumerate(segments)]
        elif self.output is None:
            raise RuntimeError("chunked loss called before bind(model_parts) found the output projection")
        else:
            return self._chunked(self.output, out, segments, weights, scale)
        main = losses[0] * scale
        if len(losses) == 1:
            return main
        mtp = sum(losses[1:]) * (scale / (len(losses) - 1))
        weighted = mtp * self.mtp_weight
        return _with_mtp(main + (weighted - weighted.detach()), mtp)

    def _chunked(
        self,
        output: nn.Module,
        hidden: torch.Tensor,
        segments: list[torch.Tensor],
        weights: list[float],
        scale: torch.Tensor,
    ):
        """Chunks never straddle two segments (the main rows, then each MTP depth's): a chunk's
        gradient is taken at its segment's weight."""
        train = torch.is_grad_enabled() and hidden.requires_grad
        h = hidden.detach()
        if isinstance(h, DTensor):
            # Sequence parallel: every tp rank needs the whole sequence for its vocab shard (as the
            # output projection's own input hook would gather it); hidden x dim, not x vocab.
            h = h.redistribute(placements=[Replicate()] * h.device_mesh.ndim)
        shape = h.shape
        h, y = h.flatten(0, 1), torch.cat([seg.flatten() for seg in segments])
        n, step = segments[0].numel(), self.chunk_tokens
        chunks = [
            (k, s, min(s + step, (k + 1) * n)) for k in range(len(segments)) for s in range(k * n, (k + 1) * n, step)
        ]
        fsdp = isinstance(output, FSDPModule) and train
        totals = [torch.zeros((), dtype=torch.float32, device=y.device) for _ in segments]
        grad: torch.Tensor | None = None
        placements = None
        params = [p for p in output.parameters() if p.requires_grad]
        param_grads: list[torch.Tensor] | None = None
        with self._fsdp_once(output, fsdp, last=len(chunks) - 1) as before_chunk:
            for i, (k, s, e) in enumerate(chunks):
                before_chunk(i)
                chunk = h[s:e].unsqueeze(0)
                if not train:
                    totals[k] = totals[k] + _local(self.ce(output(chunk), y[s:e].unsqueeze(0)))
                    continue
                chunk = chunk.detach().requires_grad_(True)
                loss = self.ce(output(chunk), y[s:e].unsqueeze(0))
                weighted = loss * (scale * weights[k]) if weights[k] != 1.0 else loss * scale
                if fsdp:  # the weight's gradient through FSDP's hooks, reduce-scattered after the last chunk
                    weighted.backward()
                    g = chunk.grad
                else:  # kept here, handed over in the model's backward (DDP's hooks fire once)
                    g, *pg = torch.autograd.grad(weighted, [chunk, *params])
                    param_grads = pg if param_grads is None else [a.add_(b) for a, b in zip(param_grads, pg)]
                totals[k] = totals[k] + _local(loss.detach())
                assert g is not None
                if isinstance(g, DTensor):
                    placements = g.placements  # Partial over tp: each rank's vocab shard's share
                    g = g.to_local()
                if grad is None:
                    grad = torch.empty((h.shape[0], g.shape[-1]), dtype=g.dtype, device=g.device)
                grad[s:e] = g.squeeze(0)
        if not train:
            if isinstance(output, FSDPModule):
                output.reshard()  # evaluation keeps nothing gathered
            return totals[0] * scale
        assert grad is not None
        full = grad.view(shape)
        if isinstance(hidden, DTensor):
            assert placements is not None
            mesh = hidden.device_mesh
            full = DTensor.from_local(full, mesh, placements, run_check=False).redistribute(mesh, hidden.placements)
        if fsdp:
            loss = _HiddenGrad.apply(totals[0] * scale, [full], hidden)
        else:
            assert param_grads is not None
            loss = _HiddenGrad.apply(totals[0] * scale, [full, *param_grads], hidden, *params)
        return _with_mtp(loss, sum(totals[1:]) * (scale / (len(totals) - 1))) if len(totals) > 1 else loss

    @staticmethod
    @contextlib.contextmanager
    def _fsdp_once(output: nn.Module, fsdp: bool, last: int) -> Iterator[Callable[[int], None]]:
        """FSDP: the output weight is gathered once for all chunks and its gradient reduce-scattered
        once, after the last chunk's backward (not once per chunk)."""
        if not fsdp:
            yield lambda i: None
            return
        assert isinstance(output, FSDPModule)
        output.set_reshard_after_backward(False, recurse=False)
        output.set_requires_gradient_sync(False, recurse=False)

        def before_chunk(i: int) -> None:
            if i == last:
                output.set_reshard_after_backward(True, recurse=False)
                output.set_requires_gradient_sync(True, recurse=False)

        try:
            yield before_chunk
        finally:
            output.set_reshard_after_backward(True, recurse=False)
            output.set_requires_gradient_sync(True, recurse=False)


def _with_mtp(loss: torch.Tensor, mtp: torch.Tensor) -> torch.Tensor:
    """``loss`` carrying the call's scaled MTP loss as ``loss.mtp_loss`` (TokenLoss)."""
    loss.mtp_loss = _local(mtp.detach()).float()  # type: ignore[attr-defined]
    return loss


def mtp_loss_of(loss: torch.Tensor) -> torch.Tensor | None:
    """The scaled MTP loss a TokenLoss call's result carries (None without MTP)."""
    return getattr(loss, "mtp_loss", None)


def _local(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a replicated DTensor: its local value is the value."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def token_loss(config: JobConfig, model_args: Any, ce: LossFn = cross_entropy_sum) -> TokenLoss:
    """The run's loss: full or chunked logits (training.loss_chunk_tokens) and the model's MTP depths
    with training.mtp_loss_weight."""
    t = config.training
    return TokenLoss(t.loss_chunk_tokens, ce, mtp_depth(model_args), t.mtp_loss_weight)


class ScaledLoss:
    """``loss(out, labels, scale)`` for a caller (the pipeline schedule) that cannot pass the scale
    itself: ``with scaled_loss.scale(s): schedule.step(...)``. Called outside such a block it
    raises instead of reusing an earlier call's scale."""

    def __init__(self, loss: TokenLoss) -> None:
        self.loss = loss
        self._scale: torch.Tensor | None = None

    @contextlib.contextmanager
    def scale(self, scale: torch.Tensor) -> Iterator[None]:
        self._scale = scale
        try:
            yield
        finally:
            self._scale = None

    def __call__(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._scale is None:
            raise RuntimeError("ScaledLoss called outside a `with scale(...)` block: no scale was passed")
        return self.loss(out, labels, self._scale)
