"""The build steps of a planned run (titan/training/plan.py), one function each, shared by the
Trainer and the dry run.

The Trainer (titan/training/trainer.py) calls them in order on its device; the dry run
(titan/tools/dry_run.py) builds the model the same way as one rank of a fake process group and
stops once it is split and parallelized on the meta device. Where the two differ they pass
different arguments (the device), so neither carries a branch for the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from titan.config.job_config import JobConfig
from titan.data import MixtureLoader, TitanDataLoader, build_dataloader
from titan.errors import TitanError
from titan.log import logger
from titan.parallel.dims import ParallelDims
from titan.parallel.float8 import apply_float8, register_float8_precompute
from titan.parallel.fsdp import offload_init_device
from titan.parallel.init import init_model_weights
from titan.training.flops import mtp_output_flops_per_token
from titan.training.lr_scheduler import build_lr_schedulers
from titan.training.moe import register_moe_balancing
from titan.training.optim import OptimizersContainer, build_optimizers, cast_params_for_optimizer
from titan.training.optim_in_backward import OptimizersInBackward
from titan.training.plan import grad_accumulation_steps
from titan.training.qk_clip import QKClip

if TYPE_CHECKING:
    from titan.training.plan import RunPlan

__all__ = ["BuiltModel", "build_loader", "build_model", "build_optimizers_and_schedulers", "init_weights"]


@dataclass
class BuiltModel:
    """The model as parallelized for this rank: its parts (one per local pipeline stage, else one),
    the pipeline schedule (None without PP) and what the build counted and converted."""

    parts: list[nn.Module]
    pp_schedule: Any
    pp_has_first: bool
    pp_has_last: bool
    num_params: int
    flops_per_token: int
    float8_fqns: list[str]


def build_model(
    config: JobConfig,
    plan: RunPlan,
    dims: ParallelDims,
    device: torch.device,
    pp_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    keep_layers: Sequence[int] | None = None,
) -> BuiltModel:
    """The planned model on meta, float8-converted, then split into the plan's pipeline stages or
    parallelized whole. ``dims``: the plan's layout with this rank's mesh. Nothing is allocated:
    init_weights materializes the parts. ``keep_layers``: build only these transformer blocks (by
    layer id; the scale simulator's shorter depths, titan/tools/simulate), None: all."""
    t = config.training
    spec, model_args = plan.spec, plan.model_args
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    if keep_layers is not None:
        # Blocks keep their layer ids (as in a pipeline split): layer types, AC and seeds follow the id.
        keep = {str(i) for i in keep_layers}
        for name in [n for n in model.layers.keys() if n not in keep]:
            del model.layers[name]
    hand_over_hidden(model, t.loss_chunk_tokens > 0, spec.name)
    cast_params_for_optimizer(model, config.optimizer)
    num_params, flops_per_token = spec.get_nparams_and_flops(model, t.seq_len)
    flops_per_token += mtp_output_flops_per_token(model)
    logger.info(
        f"model {spec.name} {config.model.flavor}: {num_params:,} parameters,"
        f" {flops_per_token:,} training FLOPs/token at seq_len {t.seq_len}"
    )
    # float8 swaps Linear modules before any split or wrapping.
    float8_fqns = apply_float8(model, config.float8, device, fsdp_enabled=dims.fsdp_enabled)
    if dims.pp_enabled:
        assert spec.pipelining_fn is not None  # titan.training.plan.plan_run refused the layout otherwise
        schedule, parts, has_first, has_last = spec.pipelining_fn(
            model, dims, config, device, spec.parallelize_fn, pp_loss_fn
        )
    else:
        schedule, parts, has_first, has_last = None, [spec.parallelize_fn(model, dims, config)], True, True
    return BuiltModel(parts, schedule, has_first, has_last, num_params, flops_per_token, float8_fqns)


def hand_over_hidden(model: nn.Module, chunked_loss: bool, family: str) -> None:
    """The chunked loss applies the output projection itself: the model's last part must return
    the normed hidden states (the ``loss_owns_output`` rule of titan.models.ModelSpec)."""
    if chunked_loss and not hasattr(model, "loss_owns_output"):
        raise TitanError(
            f"config key 'training.loss_chunk_tokens' > 0 needs a model that hands its hidden states to the"
            f" loss (loss_owns_output); model {family!r} does not: set training.loss_chunk_tokens = 0"
        )
    if hasattr(model, "loss_owns_output"):
        setattr(model, "loss_owns_output", chunked_loss)  # noqa: B010 (nn.Module's __setattr__ types)


def init_weights(parts: list[nn.Module], seed: int, device: torch.device, cpu_offload: bool = False) -> None:
    """Allocate the meta parts on `device` (parameters on the host under CPU offload, buffers on
    `device` still) and initialize them from `seed`, in training mode."""
    for part in parts:
        part.to_empty(device=offload_init_device(device, cpu_offload))
        init_model_weights(part, seed, buffer_device=device)
        part.train()


def build_optimizers_and_schedulers(
    config: JobConfig, parts: list[nn.Module], dims: ParallelDims, device: torch.device
) -> tuple[OptimizersContainer, Any, QKClip]:
    """Optimizers over the parts, their LR schedulers and the attention logits' tracker. After each
    step: QK-clip (when configured; first, so float8's scale precompute sees the clipped weights),
    float8's scale precompute and MoE load balancing."""
    container = OptimizersInBackward if config.optimizer.early_step_in_backward else OptimizersContainer
    optimizers: OptimizersContainer = build_optimizers(parts, config.optimizer, container)
    tau, attn_type = config.optimizer.qk_clip_threshold, config.model.attn_type
    qk_clip = QKClip(tau, parts, dims, device, attn_type, metric_freq=config.metrics.max_logit_freq)
    optimizers.register_step_post_hook(qk_clip.after_step)
    register_float8_precompute(optimizers, parts, config.float8, dims.fsdp_enabled)
    register_moe_balancing(optimizers, parts, dims)
    schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, config.training.steps, config.sources)
    return optimizers, schedulers, qk_clip


def build_loader(
    config: JobConfig, tokenizer: Any, dims: ParallelDims, *, validation: bool = False
) -> TitanDataLoader | MixtureLoader:
    """This dp rank's loader: the training data (endless if training.dataset_infinite), or the
    held-out set (one pass, rewound by the validator; no worker processes to restart each time)."""
    t, v = config.training, config.validation
    dp_rank, dp_world_size = config.fault_tolerance.data_shard(dims.dp_rank(), dims.dp_degree)
    loader = build_dataloader(
        dataset=v.dataset if validation else t.dataset,
        dataset_path=v.dataset_path if validation else t.dataset_path,
        text_field=t.dataset_text_field,
        txt_split=t.dataset_txt_split,
        bad_lines=t.dataset_bad_lines,
        tokenizer=tokenizer,
        seq_len=t.seq_len,
        local_batch_size=v.local_batch_size if validation and v.local_batch_size > 0 else t.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        num_workers=0 if validation else t.dataloader_num_workers,
        infinite=False if validation else t.dataset_infinite,
        shuffle_seed=None if validation else t.dataset_shuffle_seed,
        mixture=v.mixture if validation else t.mixture,
        mixture_exhausted=t.mixture_exhausted,
        validation=validation,
        pin_memory=False if validation else t.dataloader_pin_memory,
        prefetch_factor=None if validation else t.dataloader_prefetch_factor,
        dataset_config=v.dataset_config if validation else t.dataset_config,
        dataset_split=v.dataset_split if validation else t.dataset_split,
    )
    if isinstance(loader, TitanDataLoader) and not validation:  # so an epoch boundary can say how early it is
        loader.run_batches = t.steps * grad_accumulation_steps(config, dims.dp_degree)
    return loader
