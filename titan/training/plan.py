"""The run plan: what a run is going to build, decided and checked before any process group or model.

``plan_run`` is the one place where a config meets the world size and the device: it runs the
config's runtime checks (titan.training.checks.validate_job), then lays out the ranks, sizes the
model (from its flavor, the tokenizer's vocabulary and the run's sequence length), splits it into
pipeline stages, works out the gradient accumulation, and checks all of it together
(``check_run``). The Trainer and the dry run (titan/tools/dry_run.py) both start from it, so the
run a dry run describes is the run a launch builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan.checkpointing.hf_check import check_routing_bias_export
from titan.config.job_config import JobConfig
from titan.data import build_tokenizer, check_data
from titan.errors import TitanError
from titan.log import logger
from titan.models import ModelSpec, get_model_spec, model_args_from_config
from titan.models.mtp import mtp_depth, mtp_stage_modules
from titan.parallel.dims import ParallelDims, check_layout
from titan.parallel.float8 import check_float8_grouped_mm
from titan.parallel.pp_layout import FIRST_MODULES, LAST_MODULES, split_modules
from titan.training.qk_clip import check_qk_clip
from titan.training.validation import validate_job

__all__ = ["ModelPlan", "RunPlan", "check_run", "grad_accumulation_steps", "plan_model", "plan_run", "run_model_args"]


@dataclass(frozen=True)
class ModelPlan:
    """How the model is cut and transformed: the module names of every pipeline stage (one stage
    holding every module without pipeline parallelism) and the transforms the build applies."""

    stages: tuple[tuple[str, ...], ...]
    float8: bool
    activation_checkpoint: str
    compiled: tuple[str, ...]  # the compiled components; empty when compile is off

    def transforms(self, float8_layers: int | None = None) -> str:
        """The transforms as one phrase; ``float8_layers``: how many Linear layers the build converted."""
        parts = []
        if self.float8 and float8_layers:
            parts.append(f"float8 on {float8_layers} Linear layers")
        if self.activation_checkpoint != "none":
            parts.append(f"activation checkpointing {self.activation_checkpoint}")
        if self.compiled:
            parts.append(f"torch.compile ({', '.join(self.compiled)})")
        return ", ".join(parts) or "none"


@dataclass
class RunPlan:
    """Everything decided about a run before it starts: the layout (degrees only; the Trainer builds
    its mesh), the model spec and args as the run builds them, the gradient accumulation steps, the
    model plan and the tokenizer (None for a dry run away from the tokenizer file)."""

    parallel_dims: ParallelDims
    spec: ModelSpec
    model_args: Any
    grad_accum_steps: int
    model_plan: ModelPlan
    tokenizer: Any

    @property
    def eos_id(self) -> int | None:
        """block_causal: documents end at the tokenizer's EOS (the packer writes BOS ... EOS per document)."""
        if self.tokenizer is None or self.model_args.attn_mask_type != "block_causal":
            return None
        return self.tokenizer.eos_id


def plan_run(config: JobConfig, world_size: int, device_type: str, *, data_here: bool = True) -> RunPlan:
    """Check ``config`` for a run of ``world_size`` ranks on ``device_type`` devices and plan it.

    ``data_here`` False (the dry run, on a machine that may lack the cluster's files): a missing
    tokenizer file leaves the flavor's vocabulary and the data sources are not looked at."""
    spec, model_args, tokenizer = plan_model(config, data_here=data_here)
    dims = _parallel_dims(config, world_size)
    grad_accum_steps = grad_accumulation_steps(config, dims.dp_degree)
    if dims.pp_enabled and spec.pipelining_fn is None:
        raise TitanError(
            f"model.name {spec.name!r} has no pipeline split; set parallelism.pipeline_parallel_degree to 1"
        )
    check_run(config, dims, model_args, device_type)
    return RunPlan(dims, spec, model_args, grad_accum_steps, _model_plan(config, dims, model_args), tokenizer)


def plan_model(config: JobConfig, *, data_here: bool = True) -> tuple[ModelSpec, Any, Any]:
    """The checks that need no world size: the config's runtime checks, the tokenizer, the data it
    reads and the model args as the run builds them. Returns (spec, model args, tokenizer or None)."""
    validate_job(config)
    spec = get_model_spec(config.model.name)
    if data_here:
        tokenizer = build_tokenizer(config.model.tokenizer_path)
        check_data(config, tokenizer)  # a typo'd dataset or a store of another tokenizer fails before the model
    else:
        tokenizer = _tokenizer(config)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else None
    return spec, run_model_args(config, model_args_from_config(spec, config.model), vocab_size), tokenizer


def check_run(config: JobConfig, dims: ParallelDims, model_args: Any, device_type: str) -> None:
    """Every check that needs the world size, the model args or the device, for GPUs of
    ``device_type`` (the dry run checks for the GPUs it stands in for, on a CPU). The Trainer runs
    it again when weights brought in changed the model args."""
    if (
        config.model.attn_type == "varlen"
        and device_type == "cuda"
        and config.training.mixed_precision_param == "float32"
    ):
        raise TitanError(
            'model.attn_type = "varlen" runs torch\'s flash varlen kernel on CUDA, which takes bfloat16 or'
            ' float16: set training.mixed_precision_param = "bfloat16", or use sdpa or flex with'
            ' attn_mask_type = "block_causal" in float32'
        )
    if config.simulate.rank >= dims.world_size:  # the rank scripts/simulate.py plays
        raise TitanError(
            f"config key 'simulate.rank' got {config.simulate.rank}; valid: 0 .. {dims.world_size - 1}"
            f" (the ranks of a {dims.world_size}-rank job)"
        )
    compiled = config.compile.enable and "model" in config.compile.components
    check_layout(
        dims, config.parallelism, model_args, config.training.seq_len, device_type, config.model.attn_type, compiled
    )
    check_float8_grouped_mm(config.float8, device_type, dims.pp, dims.cp)
    if hasattr(model_args, "linear_attn_backend"):
        from titan.models.linear_attention.kernels import check_backend

        check_backend(model_args.linear_attn_backend, device_type)
    family_check = getattr(model_args, "check_parallelism", None)
    if family_check is not None:  # the layouts a family cannot run, said by its args (before any process group)
        family_check(dims.tp, dims.cp)
    check_routing_bias_export(config.checkpoint, model_args)
    check_mtp(model_args, dims.cp, config.training.seq_len)
    if config.profiling.enable_memory_snapshot and device_type != "cuda":
        raise TitanError(
            "profiling.enable_memory_snapshot needs CUDA (it records the CUDA caching allocator's"
            f" history); this run is on {device_type}: set it to false"
        )
    # The two checks below live beside what they check (FSDP2, the optimizer), whose modules import
    # DTensor and torch's checkpointing (seconds of CPU): a pre-check imports them only when the
    # config turns the feature on.
    if config.training.enable_cpu_offload:
        from titan.parallel.fsdp import check_cpu_offload

        check_cpu_offload(dims.fsdp_enabled, config.float8, config.training.nonfinite, device_type)
    if config.optimizer.early_step_in_backward:
        from titan.training.optim_in_backward import check_step_in_backward

        check_step_in_backward(config.optimizer, config.training, dims)
    check_qk_clip(config, dims)


def check_mtp(model_args: Any, cp: int, seq_len: int) -> None:
    """Multi-token prediction shifts tokens and labels along the whole window (titan.models.mtp):
    not across context-parallel shards, and by less than the window."""
    depth = mtp_depth(model_args)
    if depth and cp > 1:
        raise TitanError(
            f"model.mtp_depth = {depth} shifts tokens along the whole window, which context parallelism"
            f" splits: set parallelism.context_parallel_degree to 1 (got {cp}) or model.mtp_depth to 0"
        )
    if depth >= seq_len:
        raise TitanError(f"config key 'model.mtp_depth' got {depth}; valid: 0 .. training.seq_len - 1 ({seq_len - 1})")


def grad_accumulation_steps(config: JobConfig, dp_degree: int) -> int:
    """Micro-batches per optimizer step: training.global_batch_size over local batch x dp degree."""
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


def run_model_args(config: JobConfig, model_args: Any, vocab_size: int | None) -> Any:
    """The model args as this run builds them: the tokenizer's vocabulary (when there is one) and
    the training sequence length, attention and init from the config."""
    rows = config.model.vocab_size
    if rows is not None:
        if vocab_size is not None and rows < vocab_size:
            raise TitanError(
                f"config key 'model.vocab_size' got {rows}; valid: at least the tokenizer's vocabulary size"
                f" {vocab_size} ({config.model.tokenizer_path or 'the shipped tokenizer'}), or unset"
            )
        vocab_size = rows
    if vocab_size is not None and model_args.vocab_size != vocab_size:
        why = "model.vocab_size" if rows is not None else "from the tokenizer"
        logger.info(f"model vocab_size {model_args.vocab_size} -> {vocab_size} ({why})")
        model_args.vocab_size = vocab_size
    model_args.max_seq_len = config.training.seq_len
    model_args.attn_type = config.model.attn_type
    model_args.attn_mask_type = config.model.attn_mask_type
    model_args.depth_init = config.model.depth_init
    if hasattr(model_args, "linear_attn_backend"):  # families with linear-attention layers
        model_args.linear_attn_backend = config.model.linear_attn_backend
    elif config.model.linear_attn_backend != "auto":
        raise TitanError(
            f"config key 'model.linear_attn_backend' got {config.model.linear_attn_backend!r}; valid: auto"
            f" (model {config.model.name} {config.model.flavor} has no linear-attention layers)"
        )
    moe_args = getattr(model_args, "moe_args", None)  # families with MoE layers
    if moe_args is not None:
        moe_args.force_load_balance = config.debug.moe_force_load_balance
        balance, aux = config.model.moe_load_balance_coeff, config.model.moe_aux_loss_coeff
        if balance is not None:
            moe_args.load_balance_coeff = balance if balance > 0 else None
        if aux is not None:
            moe_args.aux_loss_coeff = aux
    else:
        for key in ("moe_load_balance_coeff", "moe_aux_loss_coeff"):
            if getattr(config.model, key) is not None:
                raise TitanError(
                    f"config key 'model.{key}' got {getattr(config.model, key)!r}; valid: unset"
                    f" (model {config.model.name} {config.model.flavor} has no MoE layers)"
                )
    return model_args


def _parallel_dims(config: JobConfig, world_size: int) -> ParallelDims:
    par = config.parallelism
    return ParallelDims(
        dp_replicate=par.data_parallel_replicate_degree,
        dp_shard=par.data_parallel_shard_degree,
        cp=par.context_parallel_degree,
        tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree,
        world_size=world_size,
        enable_loss_parallel=not par.disable_loss_parallel,
        ep=par.expert_parallel_degree,
        etp=par.expert_tensor_parallel_degree,
    )


def _tokenizer(config: JobConfig) -> Any:
    """The tokenizer, or None (with a warning) where its file may live only on the cluster."""
    try:
        return build_tokenizer(config.model.tokenizer_path)
    except TitanError as e:
        logger.warning(f"dry run without the tokenizer, using the flavor's vocab_size: {e}")
        return None


def _model_plan(config: JobConfig, dims: ParallelDims, model_args: Any) -> ModelPlan:
    n = model_args.n_layers
    if dims.pp_enabled:
        stages = split_modules(n, dims.pp, config.parallelism)
    else:
        stages = [[*FIRST_MODULES, *(f"layers.{i}" for i in range(n)), *LAST_MODULES]]
    stages = mtp_stage_modules(stages, model_args)
    c = config.compile
    return ModelPlan(
        stages=tuple(tuple(s) for s in stages),
        float8=config.float8.enable_float8_linear,
        activation_checkpoint=config.activation_checkpoint.mode,
        compiled=tuple(c.components) if c.enable else (),
    )
