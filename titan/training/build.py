"""The build steps of a run, one function each, shared by the Trainer and the dry run.

The Trainer (titan/training/trainer.py) calls them in order on its device; the dry run
(titan/tools/dry_run.py) calls the same ones as one rank of a fake process group and stops once
the model is split and parallelized on the meta device. Where the two differ they pass different
arguments (the device, the device type the layout is checked for), so neither carries a branch
for the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from titan.config.job_config import JobConfig
from titan.data import MixtureLoader, TitanDataLoader, build_dataloader
from titan.errors import TitanError
from titan.log import logger
from titan.models import ModelSpec, get_model_spec, model_args_from_config
from titan.parallel.dims import ParallelDims, check_layout
from titan.parallel.float8 import apply_float8, register_float8_precompute
from titan.parallel.fsdp import check_cpu_offload, offload_init_device
from titan.parallel.init import init_model_weights
from titan.training.lr_scheduler import build_lr_schedulers
from titan.training.optim import OptimizersContainer, build_optimizers, cast_params_for_optimizer
from titan.training.optim_in_backward import OptimizersInBackward, check_step_in_backward

__all__ = [
    "BuiltModel", "build_loader", "build_model", "build_optimizers_and_schedulers", "build_parallel_dims",
    "check_run_config", "check_run_layout", "grad_accumulation_steps", "init_weights", "model_spec_and_args",
    "run_model_args",
]


def build_parallel_dims(config: JobConfig, world_size: int) -> ParallelDims:
    par = config.parallelism
    return ParallelDims(
        dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=par.data_parallel_shard_degree,
        cp=par.context_parallel_degree,
        tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree,
        world_size=world_size,
        enable_loss_parallel=not par.disable_loss_parallel,
    )


def grad_accumulation_steps(config: JobConfig, dp_degree: int) -> int:
    t = config.training
    per_pass = t.local_batch_size * dp_degree
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_pass:
        raise TitanError(
            f"config key 'training.global_batch_size' got {t.global_batch_size}; it must be a multiple of"
            f" local_batch_size x data-parallel degree = {t.local_batch_size} x {dp_degree} = {per_pass}"
        )
    return t.global_batch_size // per_pass


def check_run_config(config: JobConfig, dims: ParallelDims) -> int:
    """Checks that need the world size but no process group or model (the config's own checks
    ran in titan.training.checks.validate_job); returns the gradient accumulation steps."""
    return grad_accumulation_steps(config, dims.dp_degree)


def model_spec_and_args(config: JobConfig) -> tuple[ModelSpec, Any]:
    spec = get_model_spec(config.model.name)
    return spec, model_args_from_config(spec, config.model)


def check_run_layout(config: JobConfig, dims: ParallelDims, model_args: Any, device_type: str) -> None:
    """The layout against the model's shapes, for GPUs of `device_type` (the dry run checks for the
    GPUs it stands in for, on a CPU)."""
    compiled = config.compile.enable and "model" in config.compile.components
    if config.model.attn_type == "varlen" and device_type == "cuda" and config.training.mixed_precision_param == "float32":
        raise TitanError('model.attn_type = "varlen" runs torch\'s flash varlen kernel on CUDA, which takes bfloat16 or'
                         ' float16: set training.mixed_precision_param = "bfloat16", or use sdpa or flex with'
                         ' attn_mask_type = "block_causal" in float32')
    check_layout(dims, config.parallelism, model_args, config.training.seq_len, device_type,
                 config.model.attn_type, compiled)
    if config.training.enable_cpu_offload:
        check_cpu_offload(dims.fsdp_enabled, config.float8, config.training.nonfinite, device_type)
    check_step_in_backward(config.optimizer, config.training, dims)


def run_model_args(config: JobConfig, model_args: Any, vocab_size: int | None) -> Any:
    """The model args as this run builds them: the tokenizer's vocabulary (when there is one) and
    the training sequence length, attention and init from the config."""
    if vocab_size is not None and model_args.vocab_size != vocab_size:
        logger.info(f"model vocab_size {model_args.vocab_size} -> {vocab_size} (from the tokenizer)")
        model_args.vocab_size = vocab_size
    model_args.max_seq_len = config.training.seq_len
    model_args.attn_type = config.model.attn_type
    model_args.attn_mask_type = config.model.attn_mask_type
    model_args.depth_init = config.model.depth_init
    return model_args


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


def build_model(config: JobConfig, spec: ModelSpec, model_args: Any, dims: ParallelDims, device: torch.device,
                pp_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> BuiltModel:
    """The model on meta, float8-converted, then split into pipeline stages or parallelized whole.
    Nothing is allocated: init_weights materializes the parts."""
    t = config.training
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    cast_params_for_optimizer(model, config.optimizer)
    num_params, flops_per_token = spec.get_nparams_and_flops(model, t.seq_len)
    logger.info(
        f"model {spec.name} {config.model.flavor}: {num_params:,} parameters,"
        f" {flops_per_token:,} training FLOPs/token at seq_len {t.seq_len}"
    )
    # float8 swaps Linear modules before any split or wrapping.
    float8_fqns = apply_float8(model, config.float8, device, fsdp_enabled=dims.fsdp_enabled)
    if dims.pp_enabled:
        schedule, parts, has_first, has_last = spec.pipelining_fn(
            model, dims, config, device, spec.parallelize_fn, pp_loss_fn
        )
    else:
        schedule, parts, has_first, has_last = None, [spec.parallelize_fn(model, dims, config)], True, True
    return BuiltModel(parts, schedule, has_first, has_last, num_params, flops_per_token, float8_fqns)


def init_weights(parts: list[nn.Module], seed: int, device: torch.device, cpu_offload: bool = False) -> None:
    """Allocate the meta parts on `device` (parameters on the host under CPU offload, buffers on
    `device` still) and initialize them from `seed`, in training mode."""
    for part in parts:
        part.to_empty(device=offload_init_device(device, cpu_offload))
        init_model_weights(part, seed, buffer_device=device)
        part.train()


def build_optimizers_and_schedulers(config: JobConfig, parts: list[nn.Module], dims: ParallelDims):  # noqa: ANN201
    """Optimizers over the parts (with float8's scale precompute after each step when configured)
    and their LR schedulers."""
    container = OptimizersInBackward if config.optimizer.early_step_in_backward else OptimizersContainer
    optimizers: OptimizersContainer = build_optimizers(parts, config.optimizer, container)
    register_float8_precompute(optimizers, parts, config.float8, dims.fsdp_enabled)
    return optimizers, build_lr_schedulers(optimizers, config.lr_scheduler, config.training.steps)


def build_loader(config: JobConfig, tokenizer: Any, dims: ParallelDims, *,
                 validation: bool = False) -> TitanDataLoader | MixtureLoader:
    """This dp rank's loader: the training data (endless if training.dataset_infinite), or the
    held-out set (one pass, rewound by the validator; no worker processes to restart each time)."""
    t, v = config.training, config.validation
    return build_dataloader(
        dataset=v.dataset if validation else t.dataset,
        dataset_path=v.dataset_path if validation else t.dataset_path,
        text_field=t.dataset_text_field,
        txt_split=t.dataset_txt_split,
        bad_lines=t.dataset_bad_lines,
        tokenizer=tokenizer,
        seq_len=t.seq_len,
        local_batch_size=v.local_batch_size if validation and v.local_batch_size > 0 else t.local_batch_size,
        dp_rank=dims.dp_rank(),
        dp_world_size=dims.dp_degree,
        num_workers=0 if validation else t.dataloader_num_workers,
        infinite=False if validation else t.dataset_infinite,
        shuffle_seed=None if validation else t.dataset_shuffle_seed,
        mixture=v.mixture if validation else t.mixture,
        mixture_exhausted=t.mixture_exhausted,
        validation=validation,
        pin_memory=False if validation else t.dataloader_pin_memory,
        prefetch_factor=None if validation else t.dataloader_prefetch_factor,
    )
