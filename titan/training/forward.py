"""One batch through the model, for training and for evaluation, with or without the pipeline schedule.

``ModelForward`` holds what both need: the model parts, the pipeline schedule and which stages
this rank holds, the loss (titan.training.loss.TokenLoss: full logits or chunked), loss parallel
(cross entropy on vocab-sharded DTensor logits),
the autocast context and the document ids block-causal attention masks with. The Trainer calls
``forward_backward`` each micro-batch; the Validator is handed ``eval_loss_sum``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan.models.documents import document_ids
from titan.models.moe import aux_loss_scale
from titan.models.mtp import mtp_labels
from titan.training.loss import IGNORE_INDEX, ScaledLoss, TokenLoss, mtp_loss_of

__all__ = ["ModelForward"]


def _mtp(loss: torch.Tensor) -> torch.Tensor | float:
    mtp = mtp_loss_of(loss)
    return 0.0 if mtp is None else mtp


def _replicated(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a replicated DTensor: take the plain value."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class ModelForward:
    """``parts``: the model parts of this rank; ``pp_schedule`` (None without PP) calls
    ``pp_loss`` (built around ``loss``) on the last stage; ``pp_group``: the pp process group."""

    def __init__(
        self,
        parts: list[nn.Module],
        loss: TokenLoss,
        *,
        device: torch.device,
        loss_parallel_enabled: bool,
        amp: contextlib.AbstractContextManager,
        eos_id: int | None,
        pp_schedule: Any = None,
        pp_loss: ScaledLoss | None = None,
        pp_has_first: bool = True,
        pp_has_last: bool = True,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if pp_schedule is not None and (pp_loss is None or pp_group is None):
            raise ValueError("a pipeline schedule needs the ScaledLoss it was built with and the pp group")
        self.parts, self.loss, self.device = parts, loss, device
        loss.bind(parts)  # the chunked loss applies the output projection of these parts
        self.loss_parallel_enabled, self.amp, self.eos_id = loss_parallel_enabled, amp, eos_id
        self.pp_schedule, self.pp_loss, self.pp_group = pp_schedule, pp_loss, pp_group
        self.pp_has_first, self.pp_has_last = pp_has_first, pp_has_last
        # The step's MTP losses (titan.models.mtp) as the loss returned them (x dp ranks / global tokens).
        self._mtp_sum = torch.zeros((), device=device)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.loss_parallel_enabled else contextlib.nullcontext()

    def _doc_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """block_causal: each position's document, once per batch, for the model to build its mask from
        before its (compiled, checkpointed) blocks; a tensor, so the pipeline schedule splits it too."""
        return {} if self.eos_id is None else {"doc_ids": document_ids(inputs, self.eos_id)}

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, global_tokens: torch.Tensor, dp_scale: int
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its loss (token-loss sum over
        ``global_tokens``, detached). The backward pass sees it times ``dp_scale``."""
        docs = self._doc_kwargs(inputs)
        if self.loss.mtp_depth:  # each depth's labels beside the next-token ones: [B, 1 + depth, S]
            labels = mtp_labels(labels, self.loss.mtp_depth, IGNORE_INDEX, docs.get("doc_ids"))
        if self.pp_schedule is not None:
            assert self.pp_loss is not None
            with self.pp_loss.scale(dp_scale / global_tokens), aux_loss_scale(dp_scale / global_tokens):
                loss = self._pp_run(self.pp_schedule.step, inputs, labels, docs) / dp_scale
        else:
            # MoE balance losses reach the backward pass normalised like the token loss.
            with self._loss_context(), aux_loss_scale(dp_scale / global_tokens):
                # The loss inside autocast: the chunked loss applies the output projection itself.
                with self.amp:
                    scaled = self.loss(self.parts[0](inputs, **docs), labels, dp_scale / global_tokens)
                scaled.backward()
            loss = _replicated(scaled.detach()) / dp_scale
            self._mtp_sum += _mtp(scaled)
        return loss

    def mtp_log_tensors(self, log: bool, dims: Any) -> dict[str, torch.Tensor]:
        """The trainer's hook after each step: {"mtp_loss": the step's MTP loss (the mean over
        depths, unweighted), summed over the pipeline stages and dp x cp ranks} on log steps, {}
        otherwise and without MTP; the step's sum restarts either way. ``dims``: ParallelDims."""
        if not self.loss.mtp_depth:
            return {}
        total, self._mtp_sum = self._mtp_sum / (dims.dp_degree * dims.cp), torch.zeros((), device=self.device)
        if not log:
            return {}
        dp_cp = dims.submesh("dp_cp")
        for group in (self.pp_group, dp_cp.get_group() if dp_cp is not None else None):
            if group is not None:  # only the last stage has it; dp x cp ranks saw other tokens
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return {"mtp_loss": total}

    def eval_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Validation forward (titan/training/validator.py): the batch's summed token loss, on every pp stage."""
        if self.pp_schedule is None:
            with self._loss_context(), self.amp:
                out = self.parts[0](inputs, **self._doc_kwargs(inputs))
                return _replicated(self.loss(out, labels, torch.ones((), device=self.device)))
        assert self.pp_loss is not None
        with self.pp_loss.scale(torch.ones((), device=self.device)):  # the schedule's loss then sums
            return self._pp_run(self.pp_schedule.eval, inputs, labels, self._doc_kwargs(inputs))

    def _pp_run(
        self, run: Callable[..., Any], inputs: torch.Tensor, labels: torch.Tensor, docs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Drive one schedule call (step or eval). The last stage holds the losses; a sum over the
        pp group hands their total to every stage (rank 0 logs it). ``docs``: the document ids
        every stage builds its attention mask from."""
        targets, losses = (labels, []) if self.pp_has_last else (None, None)
        with self._loss_context(), self.amp:
            if self.pp_has_first:
                run(inputs, target=targets, losses=losses, **docs)
            else:
                run(target=targets, losses=losses, **docs)
        loss = torch.zeros((), device=self.device)
        for x in losses or ():  # the last stage: its micro-batches' losses, added in order
            loss = loss + _replicated(x.detach()).float()
            self._mtp_sum += _mtp(x)  # training with MTP (TokenLoss)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pp_group)
        return loss
