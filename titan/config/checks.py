"""Checks that need nothing but the config itself: ranges and keys that only make sense together.

load_config runs them after the loader has checked every value's type and choices. Checks that
need runtime knowledge (the model registry, optimizer and pipeline-schedule names, ...) live with
the feature that owns them and run in titan.training.checks.validate_job; checks that need the world
size live with ParallelDims.
"""

from __future__ import annotations


from titan.config.job_config import JobConfig
from titan.errors import TitanError, require

# Model-shape keys that override the flavor's value when set.
SHAPE_OVERRIDES = ("n_layers", "dim", "n_heads", "n_kv_heads")


def check_config(c: JobConfig) -> None:
    t = c.training
    require(t.steps >= 1, "training.steps", t.steps, "an integer >= 1")
    require(t.local_batch_size >= 1, "training.local_batch_size", t.local_batch_size, "an integer >= 1")
    require(
        t.global_batch_size == -1 or t.global_batch_size >= 1,
        "training.global_batch_size", t.global_batch_size, "-1 (local_batch_size x dp) or an integer >= 1",
    )
    require(t.seq_len >= 2, "training.seq_len", t.seq_len, "an integer >= 2")
    require(t.dataloader_num_workers >= 0, "training.dataloader_num_workers", t.dataloader_num_workers, "an integer >= 0")
    require(t.dataloader_prefetch_factor is None or (t.dataloader_prefetch_factor >= 1 and t.dataloader_num_workers > 0),
            "training.dataloader_prefetch_factor", t.dataloader_prefetch_factor,
            "unset, or an integer >= 1 together with training.dataloader_num_workers > 0")
    require(t.gc_freq >= 1, "training.gc_freq", t.gc_freq, "an integer >= 1")
    for section, mixture in (("training", t.mixture), ("validation", c.validation.mixture)):
        for i, src in enumerate(mixture):
            require(src.weight > 0, f"{section}.mixture[{i}].weight", src.weight, "a number > 0")
            require(bool(src.path or src.dataset), f"{section}.mixture[{i}]", src, "a table with path or dataset set")

    p = c.parallelism
    require(p.data_parallel_replicate_degree >= 1, "parallelism.data_parallel_replicate_degree",
           p.data_parallel_replicate_degree, "an integer >= 1")
    require(p.data_parallel_shard_degree == -1 or p.data_parallel_shard_degree >= 1,
           "parallelism.data_parallel_shard_degree", p.data_parallel_shard_degree, "-1 (the rest) or an integer >= 1")
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "pipeline_parallel_microbatch_size"):
        require(getattr(p, key) >= 1, f"parallelism.{key}", getattr(p, key), "an integer >= 1")
    require(p.pipeline_parallel_layers_per_stage == -1 or p.pipeline_parallel_layers_per_stage >= 1,
           "parallelism.pipeline_parallel_layers_per_stage", p.pipeline_parallel_layers_per_stage,
           "-1 (automatic) or an integer >= 1")

    require(c.job.dry_run_world_size >= 1, "job.dry_run_world_size", c.job.dry_run_world_size, "an integer >= 1")
    require(c.metrics.log_freq >= 1, "metrics.log_freq", c.metrics.log_freq, "an integer >= 1")
    require(c.metrics.param_norm_freq >= 0, "metrics.param_norm_freq", c.metrics.param_norm_freq,
           "an integer >= 0 (0: never)")
    for key in SHAPE_OVERRIDES:
        value = getattr(c.model, key)
        require(value is None or value >= 1, f"model.{key}", value, "an integer >= 1, or unset for the flavor's value")
    _check_attention(c)
    _check_checkpoint(c)


def _check_attention(c: JobConfig) -> None:
    m = c.model
    if m.attn_type == "varlen" and m.attn_mask_type != "block_causal":
        raise TitanError('config key \'model.attn_type\' = "varlen" attends within each document: it needs'
                         ' model.attn_mask_type = "block_causal" (for causal attention over the whole window use'
                         ' sdpa or flex)')
    if m.attn_mask_type == "block_causal" and c.parallelism.context_parallel_degree > 1:
        raise TitanError('config key \'model.attn_mask_type\' = "block_causal" does not combine with'
                         f" parallelism.context_parallel_degree {c.parallelism.context_parallel_degree}: titan's CP"
                         " paths (SDPA ring attention, flex with the causal mask over the head-tail rearranged rows)"
                         ' know no document boundaries; use attn_mask_type "causal" with CP')


def _check_checkpoint(c: JobConfig) -> None:
    k = c.checkpoint
    require(k.interval >= 1, "checkpoint.interval", k.interval, "an integer >= 1")
    require(k.keep_latest_k >= 0, "checkpoint.keep_latest_k", k.keep_latest_k, "0 (keep all) or an integer >= 1")
    require(k.load_step >= -1, "checkpoint.load_step", k.load_step, "-1 (latest) or a step >= 0")
    require(bool(k.folder.strip()), "checkpoint.folder", k.folder, "a non-empty folder name under job.dump_folder")
    if k.initial_load_in_hf and not k.initial_load_path:
        raise TitanError("config key 'checkpoint.initial_load_in_hf' needs checkpoint.initial_load_path (the HF folder)")
    if k.last_save_in_hf and not k.last_save_model_only:
        raise TitanError("config key 'checkpoint.last_save_in_hf' writes the final step-N as a Hugging Face folder"
                         " (model weights only): also set checkpoint.last_save_model_only (add"
                         " --checkpoint.last_save_model_only)")
    if k.last_save_in_hf and c.parallelism.pipeline_parallel_degree > 1:
        raise TitanError("config key 'checkpoint.last_save_in_hf' is not supported with pipeline parallelism"
                         " (no rank holds the whole model); export a DCP checkpoint with scripts/convert_hf.py")
    # Loading options would silently do nothing with checkpointing off.
    for key, is_set in (("initial_load_path", bool(k.initial_load_path)), ("load_step", k.load_step != -1),
                        ("last_save_in_hf", k.last_save_in_hf)):
        if is_set and not k.enable:
            raise TitanError(f"config key 'checkpoint.{key}' needs checkpoint.enable (add --checkpoint.enable)")
