"""Validation: loss and perplexity on held-out data, every ``validation.freq`` steps.

The held-out loader is finite (one pass) and rewound to its start before every validation, so
each validation scores the same tokens and the numbers are comparable over training. Each dp
rank reads its own shard; the loss is the global mean over all non-ignored tokens (sum of token
losses and token count reduced over dp). TP / PP / FSDP do not change it; a different dp degree
packs the documents into different windows, so the number moves slightly.

With context parallelism every cp rank of a dp rank reads the same batches and evaluates its
sequence shard (titan/parallel/cp.py's head-tail sharding of inputs, labels and the model's
position-indexed buffers, as in training); the sums are then reduced over dp x cp, so the loss is
that of cp 1. The forward is all validation needs, so with flex attention it runs on CPU too.

Forward passes are dp-collective under FSDP, so all ranks must run the same number of batches:
before each batch the ranks agree (all_reduce MIN) that every one of them still has data.

The model forward is handed in (``loss_sum``: the trainer's titan.training.forward.ModelForward
.eval_loss_sum): it knows tensor parallelism's loss parallel and the pipeline schedule. With
pipeline parallelism it runs ``schedule.eval`` (the first stage feeds the inputs, the last stage
passes the labels and collects the microbatch losses, with the training loss function at scale 1:
the token-loss *sum*), then sums over the pp group, so every stage holds the batch loss and all
ranks log the same value. Without one (tests, tools) the plain single-module forward is used.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from titan.config.sections.validation import Validation
from titan.data import MixtureLoader, TitanDataLoader
from titan.errors import TitanError
from titan.log import logger
from titan.parallel.cp import SeqBuffer, cp_shard_batch
from titan.parallel.dims import ParallelDims
from titan.training.loss import IGNORE_INDEX, cross_entropy_sum
from titan.training.metrics import MetricsProcessor

__all__ = ["Validator"]


class Validator:
    def __init__(
        self,
        cfg: Validation,
        *,
        last_step: int,
        model_parts: list[nn.Module],
        parallel_dims: ParallelDims,
        loader: TitanDataLoader | MixtureLoader,
        device: torch.device,
        metrics: MetricsProcessor,
        loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        cp_buffers: Sequence[SeqBuffer] = (),
        cp_rotate_method: str = "allgather",
    ) -> None:
        """``cfg`` has passed its checks and the layout checks (CP: the sequence length splits into
        2 x cp chunks, titan.training.plan.check_run); ``last_step``: training.steps (validated too);
        ``loss_sum(inputs, labels)``: the summed token loss of one batch (default: the plain
        single-module forward)."""
        self.freq, self.steps, self.last_step = cfg.freq, cfg.steps, last_step
        self.model_parts = model_parts
        self.parallel_dims = parallel_dims
        self.device = device
        self.metrics = metrics
        self.loss_sum = loss_sum if loss_sum is not None else self._single_module_loss_sum
        # Context parallel: the model's position-indexed buffers that follow each batch's sequence shard.
        self.cp_buffers, self.rotate_method = list(cp_buffers), cp_rotate_method
        self.loader = loader  # one pass over the held-out set (titan/training/build.py: build_loader)
        self._start = self.loader.state_dict()
        self.history: dict[int, float] = {}

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    def _dp_group(self, with_cp: bool = False) -> dist.ProcessGroup | None:
        dp = self.parallel_dims.submesh("dp_cp" if with_cp else "dp")
        return dp.get_group() if dp is not None else None

    def _shard_context(self, inputs: torch.Tensor, labels: torch.Tensor) -> contextlib.AbstractContextManager:
        """This cp rank's sequence shard of the batch (the whole batch without CP)."""
        cp = self.parallel_dims.submesh("cp")  # None without CP
        if cp is None:
            return contextlib.nullcontext((inputs, labels))
        return cp_shard_batch(cp, inputs, labels, self.cp_buffers, self.rotate_method)

    def _all_have_batch(self, has: bool) -> bool:
        group = self._dp_group()
        if group is None:
            return has
        flag = torch.tensor([1 if has else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def _single_module_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of the token losses of one batch (fp32); single module, no TP/PP."""
        return cross_entropy_sum(self.model_parts[0](inputs), labels)

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        self.loader.load_state_dict(self._start)
        it = iter(self.loader)
        n = 0
        while self.steps == -1 or n < self.steps:
            batch = next(it, None)
            if not self._all_have_batch(batch is not None):
                return
            assert batch is not None
            n += 1
            # a validation mixture says which source the batch came from (a loss per source)
            yield (
                batch[0].to(self.device, non_blocking=True),
                batch[1].to(self.device, non_blocking=True),
                getattr(self.loader, "last_source", 0),
            )

    @torch.no_grad()
    def validate(self, step: int) -> float:
        """Run one validation pass, log it, return the loss (the same on every rank)."""
        t0 = time.perf_counter()
        for m in self.model_parts:
            m.eval()
        # [loss sum, token count] per source in float64: token counts stay exact far beyond 2**24.
        names = getattr(self.loader, "names", [""])
        per_source = torch.zeros(len(names), 2, dtype=torch.float64, device=self.device)
        try:
            for full_inputs, full_labels, source in self._batches():
                with self._shard_context(full_inputs, full_labels) as (inputs, labels):
                    per_source[source, 0] += self.loss_sum(inputs, labels).double()
                    per_source[source, 1] += (labels != IGNORE_INDEX).sum()
        finally:
            for m in self.model_parts:
                m.train()
                # A forward without backward leaves modules that don't reshard after forward
                # (FSDP2's root by default) holding unsharded plain-tensor parameters; reshard so
                # the optimizer, norms and checkpoints see the DTensor shards again.
                for module in m.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()
        group = self._dp_group(with_cp=True)  # cp ranks hold the sums of their sequence shards
        if group is not None:
            dist.all_reduce(per_source, op=dist.ReduceOp.SUM, group=group)
        loss_sum, tokens = per_source.sum(0).tolist()
        if tokens == 0:
            raise TitanError(
                "validation data yielded no batch: the held-out set is smaller than one batch per dp"
                " rank (validation.dataset / local_batch_size / training.seq_len)"
            )
        loss = loss_sum / tokens
        seconds = time.perf_counter() - t0
        self.history[step] = loss
        self.metrics.log_validation(
            step, loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=int(tokens), seconds=seconds
        )
        if len(names) > 1:
            losses = {name: ls / n for name, (ls, n) in zip(names, per_source.tolist()) if n > 0}
            if self.metrics.log_this_rank:
                logger.info("validation loss per source: " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))
            self.metrics.write(step, {f"validation/loss/{k}": v for k, v in losses.items()})
        self.metrics.exclude_time(seconds)
        if not math.isfinite(loss):
            logger.warning(f"validation loss at step {step} is not finite ({loss})")
        return loss
