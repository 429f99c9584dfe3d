"""Checks that need nothing but the config itself: run before any process group or model exists.

Checks that need the world size or the model flavor live with ParallelDims and the model args.
"""

from __future__ import annotations

from typing import Any

from titan.config.job_config import JobConfig
from titan.errors import TitanError

DTYPES = ("float32", "bfloat16", "float16")


def _check(cond: bool, key: str, value: Any, valid: str) -> None:
    if not cond:
        raise TitanError(f"config key '{key}' got {value!r}; valid: {valid}")


def _choice(key: str, value: Any, options: tuple[str, ...]) -> None:
    _check(value in options, key, value, ", ".join(options))


def validate_config(c: JobConfig) -> None:
    t = c.training
    _check(t.steps >= 1, "training.steps", t.steps, "an integer >= 1")
    _check(t.local_batch_size >= 1, "training.local_batch_size", t.local_batch_size, "an integer >= 1")
    _check(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        "training.global_batch_size", t.global_batch_size, "-1 (local_batch_size x dp) or an integer >= 1",
    )
    _check(t.seq_len >= 2, "training.seq_len", t.seq_len, "an integer >= 2")
    _check(t.dataloader_num_workers >= 0, "training.dataloader_num_workers", t.dataloader_num_workers, "an integer >= 0")
    _check(t.gc_freq >= 1, "training.gc_freq", t.gc_freq, "an integer >= 1")
    _choice("training.dataset_bad_lines", t.dataset_bad_lines, ("fail", "skip"))
    _choice("training.dataset_txt_split", t.dataset_txt_split, ("paragraph", "line", "document"))
    _choice("training.mixed_precision_param", t.mixed_precision_param, DTYPES[:2])
    _choice("training.mixed_precision_reduce", t.mixed_precision_reduce, DTYPES[:2])

    # Sections whose builders own their checks: run those same checks now, before any work.
    from titan.train.lr_scheduler import validate_lr_scheduler_config
    from titan.train.optim import validate_optimizer_config

    validate_optimizer_config(c.optimizer)
    validate_lr_scheduler_config(c.lr_scheduler)

    from titan.parallel.comm import validate_comm_config
    from titan.train.profiling import validate_profiling_config
    from titan.train.stability import validate_stability_config
    from titan.train.validator import validate_validation_config

    validate_stability_config(c)
    validate_profiling_config(c)
    validate_validation_config(c)
    validate_comm_config(c)

    p = c.parallelism
    _check(p.data_parallel_replicate_degree >= 1, "parallelism.data_parallel_replicate_degree",
           p.data_parallel_replicate_degree, "an integer >= 1")
    _check(p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
           "parallelism.data_parallel_shard_degree", p.data_parallel_shard_degree, "-1 (the rest) or an integer >= 1")
    _choice("parallelism.fsdp_reshard_after_forward", p.fsdp_reshard_after_forward, ("default", "always", "never"))
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "pipeline_parallel_microbatch_size"):
        _check(getattr(p, key) >= 1, f"parallelism.{key}", getattr(p, key), "an integer >= 1")
    _check(p.pipeline_parallel_layers_per_stage == -1 or p.pipeline_parallel_layers_per_stage >= 1,
           "parallelism.pipeline_parallel_layers_per_stage", p.pipeline_parallel_layers_per_stage,
           "-1 (automatic) or an integer >= 1")
    _choice("parallelism.context_parallel_rotate_method", p.context_parallel_rotate_method, ("allgather", "alltoall"))
    from titan.parallel.pp import check_schedule_config

    check_schedule_config(p, t.local_batch_size)

    _check(c.job.dry_run_world_size >= 1, "job.dry_run_world_size", c.job.dry_run_world_size, "an integer >= 1")
    _check(c.metrics.log_freq >= 1, "metrics.log_freq", c.metrics.log_freq, "an integer >= 1")
    _check(c.metrics.param_norm_freq >= 0, "metrics.param_norm_freq", c.metrics.param_norm_freq,
           "an integer >= 0 (0: never)")
    _choice("model.attn_type", c.model.attn_type, ("sdpa", "flex"))
    _validate_model_shape(c)
    _validate_checkpoint(c)

    from titan.parallel.ac import AC_MODES, parse_selective_option
    from titan.parallel.compile import validate_components
    from titan.parallel.float8 import validate_float8

    _choice("activation_checkpoint.mode", c.activation_checkpoint.mode, AC_MODES)
    if c.activation_checkpoint.mode == "selective":
        parse_selective_option(c.activation_checkpoint.selective_ac_option)
    validate_components(c.compile.components)
    validate_float8(c.float8)


def _validate_model_shape(c: JobConfig) -> None:
    """Shape overrides: positive integers that fit together with the flavor's other values."""
    from titan.models import SHAPE_OVERRIDES, get_model_spec, model_args_from_config

    for key in SHAPE_OVERRIDES:
        value = getattr(c.model, key)
        _check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
               f"model.{key}", value, "an integer >= 1, or unset for the flavor's value")
    model_args_from_config(get_model_spec(c.model.name), c.model)


CHECKPOINT_PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


def _validate_checkpoint(c: JobConfig) -> None:
    k = c.checkpoint
    _check(k.interval >= 1, "checkpoint.interval", k.interval, "an integer >= 1")
    _check(k.keep_latest_k >= 0, "checkpoint.keep_latest_k", k.keep_latest_k, "0 (keep all) or an integer >= 1")
    _choice("checkpoint.async_mode", k.async_mode, ("disabled", "async", "async_with_pinned_mem"))
    _choice("checkpoint.export_dtype", k.export_dtype, DTYPES)
    _choice("checkpoint.on_save_error", k.on_save_error, ("stop", "retry"))
    _choice("checkpoint.config_mismatch", k.config_mismatch, ("error", "use_checkpoint", "use_new"))
    _check(k.load_step >= -1, "checkpoint.load_step", k.load_step, "-1 (latest) or a step >= 0")
    _check(bool(k.folder.strip()), "checkpoint.folder", k.folder, "a non-empty folder name under job.dump_folder")
    for part in k.exclude_from_loading:
        _choice("checkpoint.exclude_from_loading", part, CHECKPOINT_PARTS)
    if k.initial_load_in_hf and not k.initial_load_path:
        raise TitanError("config key 'checkpoint.initial_load_in_hf' needs checkpoint.initial_load_path (the HF folder)")
    if k.last_save_in_hf and c.parallelism.pipeline_parallel_degree > 1:
        raise TitanError("config key 'checkpoint.last_save_in_hf' is not supported with pipeline parallelism"
                         " (no rank holds the whole model); export a DCP checkpoint with scripts/convert_hf.py")
    # Loading options would silently do nothing with checkpointing off.
    for key, is_set in (("initial_load_path", bool(k.initial_load_path)), ("load_step", k.load_step != -1),
                        ("last_save_in_hf", k.last_save_in_hf)):
        if is_set and not k.enable:
            raise TitanError(f"config key 'checkpoint.{key}' needs checkpoint.enable (add --checkpoint.enable)")
