"""One rank of a planned run, built by titan's build functions and stepped by the Trainer's own step.

``SimulatedRank`` is a Trainer whose set-up stops at what one training step needs: the model as
``titan.training.build`` builds it for this rank (float8, pipeline split, TP/SP, CP, AC, FSDP/HSDP/DDP,
EP), its forward (``ModelForward``), optimizers and LR schedulers, the stability monitor and the
non-finite update mask. It starts no process group (the caller's world, fake or real, exists
already), writes nothing (no dump folder, checkpoint manager, metrics files) and reads no data: the
step is ``Trainer.train_step`` itself, on token batches of the run's shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from titan.checkpointing.states import TrainState
from titan.config.job_config import JobConfig
from titan.ft.replicas import NoReplicaGroups
from titan.parallel.dims import ParallelDims
from titan.training.build import build_model, build_optimizers_and_schedulers, init_weights
from titan.training.forward import ModelForward
from titan.training.loss import ScaledLoss, token_loss
from titan.training.moe import MoEMonitor
from titan.training.nonfinite import UpdateMask
from titan.training.plan import RunPlan
from titan.training.stability import StabilityMonitor
from titan.training.trainer import Trainer

__all__ = ["SimulatedRank"]


class _NoLogs:
    """The metrics the step touches, for a step that logs nothing (most steps of a run)."""

    def should_log(self, step: int) -> bool:
        return False

    def count_tokens(self, n: int) -> None:
        return None


class SimulatedRank(Trainer):
    """``keep_layers``: the transformer blocks to build (global indices; None: all of them).

    Trainer.__init__ is deliberately not called (it would start a process group, lock a dump folder,
    build loaders and a checkpoint manager): this sets what ``Trainer.train_step`` reads. A new
    attribute the step starts reading must be set here too (the simulator's tests run the step)."""

    def __init__(
        self,
        config: JobConfig,
        plan: RunPlan,
        dims: ParallelDims,
        device: torch.device,
        keep_layers: Sequence[int] | None = None,
    ) -> None:
        self.config, self.plan, self.parallel_dims, self.device = config, plan, dims, device
        self.grad_accum_steps = plan.grad_accum_steps
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        t = config.training
        self.stability = StabilityMonitor(
            config.stability, nonfinite=t.nonfinite, max_consecutive_skips=t.nonfinite_max_consecutive_skips
        )
        self.loss_fn = token_loss(config, plan.model_args)
        self._pp_loss = ScaledLoss(self.loss_fn)
        built = build_model(config, plan, dims, device, self._pp_loss, keep_layers=keep_layers)
        self.built = built
        self.model_parts, self.pp_schedule = built.parts, built.pp_schedule
        self.num_params, self.flops_per_token = built.num_params, built.flops_per_token
        self.float8_fqns = built.float8_fqns
        self.train_state = TrainState()
        self.metrics = _NoLogs()  # type: ignore[assignment]
        self.replicas = NoReplicaGroups()

    def materialize(self, seed: int | None) -> None:
        """Allocate the parts on the device (``seed`` None: uninitialized, as fake tensors hold no
        values; else initialized as the Trainer does), then build what the step uses."""
        if seed is None:
            for part in self.model_parts:
                part.to_empty(device=self.device)
                part.train()
        else:
            init_weights(self.model_parts, seed, self.device, cpu_offload=self.config.training.enable_cpu_offload)
        cp_buffers_fn = self.plan.spec.cp_buffers_fn
        self._cp_buffers = [b for part in self.model_parts for b in cp_buffers_fn(part)] if cp_buffers_fn else []
        pp = self.parallel_dims.submesh("pp")
        self._pp_group = pp.get_group() if pp is not None else None
        built = self.built
        self.forward = ModelForward(
            self.model_parts,
            self.loss_fn,
            device=self.device,
            loss_parallel_enabled=self.parallel_dims.loss_parallel_enabled,
            amp=self._autocast_context(),
            eos_id=self._eos_id(),
            pp_schedule=built.pp_schedule,
            pp_loss=self._pp_loss,
            pp_has_first=built.pp_has_first,
            pp_has_last=built.pp_has_last,
            pp_group=self._pp_group,
        )
        self.optimizers, self.lr_schedulers, self.qk_clip = build_optimizers_and_schedulers(
            self.config, self.model_parts, self.parallel_dims, self.device
        )
        self.update_mask = UpdateMask(
            self.optimizers, self.device, enabled=self.config.training.nonfinite == "skip_step"
        )
        self._params = [p for m in self.model_parts for p in m.parameters()]
        self.moe_monitor = MoEMonitor(self.model_parts)

    def _eos_id(self) -> int | None:
        """block_causal needs document ids; without the tokenizer file any id gives the same shapes."""
        if self.plan.tokenizer is None and self.plan.model_args.attn_mask_type == "block_causal":
            return 0
        return self.plan.eos_id

    def batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's micro-batches: random tokens of the run's shapes (this rank's local batch)."""
        t = self.config.training
        vocab = self.plan.model_args.vocab_size
        shape = (t.local_batch_size, t.seq_len)
        return [
            (torch.randint(0, vocab, shape, device=self.device), torch.randint(0, vocab, shape, device=self.device))
            for _ in range(self.grad_accum_steps)
        ]

    @property
    def experts(self) -> list[nn.Module]:
        """The routed-experts modules of this rank (where expert parallelism's routing is assumed)."""
        return [m for part in self.model_parts for m in part.modules() if hasattr(m, "down_bias_shares")]
