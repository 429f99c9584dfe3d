"""torchtitan's config keys that titan spells differently or does not implement: the table that
titan/config/dialects.py applies to TOML files and command lines, and that
docs/config_reference.md lists.

Every key torchtitan's job config had, from its 2024 argparse form (and the SageMaker guide's
TOML) through v0.1.0 to v0.2.2, is either one of titan's own keys with the same meaning (see
TORCHTITAN_KEYS; nothing to do), or a rule below:

- ``rename``: another key name (and maybe a value mapping) for the same setting;
- ``refuse``: a setting titan does not implement. Values listed as ``neutral`` (torchtitan's
  default, which does nothing in either library) are accepted with a logged note; any other value
  stops with "torchtitan key 'X' is not supported by titan: <why>".
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from titan.config.dialect_mappings import (
    V010,
    V02,
    Y2024,
    Rule,
    as_bool,
    comm_mode,
    config_module,
    converters,
    dataset,
    flavor,
    fused,
    layers_per_stage,
    log_rank,
    mapped,
    negate,
    no_effect,
    optional_str,
    recipe,
    refuse,
    rename,
    selective_option,
)

_FLOAT8_SECTION = (
    "enable_fsdp_float8_all_gather",
    "precompute_float8_dynamic_scale_for_fsdp",
    "filter_fqns",
    "emulate",
)
_MX = 'MX (microscaling) training is not in titan; use model.converters = ["float8"] (float8 linears)'
_MOE = "titan's models are dense (no mixture of experts)"
_DUALPIPE = "read only by torchtitan's DualPipeV schedule with EP; titan's EP all-to-alls run inside the MoE layer"
_F8_MOE = "v0.1.0's float8 MoE prototype; titan's is float8.enable_float8_grouped_mm with float8.grouped_mm_fqns"
_MX_MOE = (
    "read only by the MX grouped-GEMM converter: MX (microscaling) needs Blackwell GPUs (SM100) and is not"
    ' in titan; float8 grouped GEMMs are (model.converters = ["quantize.grouped_mm.float8"])'
)
_DEEPEP = (
    'DeepEP (its fused NVSHMEM dispatch/combine kernels) is not available to titan; use "standard"'
    " (all-to-all over the expert-parallel process group)"
)
_PLUGIN = "titan has no plug-in config or model modules; add a section module under titan/config/sections/"
_VAL_LOADER = "titan's validation loader runs in the training process (no worker processes)"


def _rules() -> list[Rule]:
    r = [
        # ---- job
        rename("job.print_args", "job.print_config", f"{Y2024}–{V010}"),
        no_effect(
            "job.use_for_integration_test",
            f"{Y2024}–{V010}",
            "a tag torchtitan's CI used to pick config files; nothing reads it at run time",
        ),
        refuse(
            "job.save_config_file", V02, "titan always writes the merged config to <job.dump_folder>/config.toml", None
        ),
        # torchtitan's llama3_ft config names the module that adds its [fault_tolerance] keys;
        # titan has those keys built in, so that one module name is accepted (and nothing else).
        mapped("job.custom_config_module", "fault_tolerance.enable", V02, config_module),
        refuse("experimental.custom_import", f"{Y2024}–{V02}", _PLUGIN, ""),
        refuse("experimental.custom_args_module", f"{Y2024}–{V02}", _PLUGIN, ""),
        refuse("experimental.custom_model_path", Y2024, _PLUGIN, ""),
        # ---- profiling / metrics
        rename("profiling.profiler_active", "profiling.active_steps", V02),
        rename("profiling.profiler_warmup", "profiling.warmup_steps", V02),
        rename("profiling.run_profiler", "profiling.enable_profiling", Y2024),
        rename("profiling.profile_every_x_iter", "profiling.profile_freq", Y2024),
        mapped("metrics.save_for_all_ranks", "metrics.log_rank", f"{V010}–{V02}", log_rank(all_ranks=True)),
        mapped("metrics.rank_0_only", "metrics.log_rank", Y2024, log_rank(all_ranks=False)),
        negate("metrics.enable_color_printing", "metrics.disable_color_printing", Y2024),
        refuse("metrics.disable_logging_from_checkpoint", Y2024, "titan logs checkpoint events always", False),
        # ---- model
        mapped("model.flavor", "model.flavor", f"{V010}–{V02}", flavor),
        rename("model.hf_assets_path", "model.tokenizer_path", V02),
        mapped("model.converters", "float8.enable_float8_linear", f"{V010}–{V02}", converters),
        refuse(
            "model.print_after_conversion",
            f"{V010}–{V02}",
            "titan does not print the model; --job.dry_run prints the parallelized plan",
            False,
        ),
        refuse(
            "model.norm_type",
            Y2024,
            "titan's Llama uses RMSNorm (fused_rmsnorm is the same math)",
            "rmsnorm",
            "fused_rmsnorm",
        ),
        mapped(
            "model.use_flex_attn",
            "model.attn_type",
            Y2024,
            lambda v: [("model.attn_type", "flex" if as_bool("model.use_flex_attn", v) else "sdpa")],
        ),
        # ---- optimizer / lr
        mapped("optimizer.fused", "optimizer.implementation", Y2024, fused),
        rename("lr_scheduler.lr_min", "lr_scheduler.min_lr_factor", V010),
        rename("training.warmup_steps", "lr_scheduler.warmup_steps", Y2024),
        # ---- training
        rename("training.batch_size", "training.local_batch_size", f"{Y2024}–{V010}"),
        rename("training.compile", "compile.enable", f"{Y2024}–{V010}"),
        mapped(
            "training.dataset",
            "training.dataset",
            f"{Y2024}–{V02}",
            dataset("training.dataset", "training.dataset", "pydoc"),
        ),
        mapped(
            "validation.dataset",
            "validation.dataset",
            V02,
            dataset("validation.dataset", "validation.dataset", "pydoc_validation"),
        ),
        refuse(
            "training.dtype",
            V02,
            "bf16 parameters without an fp32 copy are optimizer.bf16_stochastic_round in"
            " titan (bf16 weights updated with stochastic rounding); FSDP bf16 compute is"
            " training.mixed_precision_param",
            "float32",
        ),
        refuse("training.gc_debug", f"{V010}–{V02}", "titan's garbage collection has no debug mode", False),
        rename("training.debug_moe_force_load_balance", "debug.moe_force_load_balance", V02),
        rename("training.dataloader.num_workers", "training.dataloader_num_workers", V02),
        rename("training.dataloader.pin_memory", "training.dataloader_pin_memory", V02),
        rename("training.dataloader.prefetch_factor", "training.dataloader_prefetch_factor", V02),
        no_effect(
            "training.dataloader.persistent_workers",
            V02,
            "titan's training loader is iterated once per run, so its workers live for the whole run anyway",
        ),
        refuse("validation.dataloader.num_workers", V02, _VAL_LOADER, 0),
        refuse("validation.dataloader.pin_memory", V02, _VAL_LOADER, False),
        refuse("validation.dataloader.persistent_workers", V02, _VAL_LOADER, False),
        refuse("validation.dataloader.prefetch_factor", V02, _VAL_LOADER, None),
        rename("validation.enabled", "validation.enable", V02),
        Rule(
            "validation.seq_len",
            V02,
            "training.seq_len",
            must_equal=True,
            why="titan validates at training.seq_len; set both to the same length",
        ),
        # ---- debug (v0.2.1+)
        rename("debug.seed", "training.seed", V02),
        rename("debug.deterministic", "training.deterministic", V02),
        refuse(
            "debug.deterministic_warn_only",
            V02,
            "titan's deterministic mode always raises on a nondeterministic op",
            False,
        ),
        # ---- 2024 parallelism spellings
        rename("training.data_parallel_degree", "parallelism.data_parallel_shard_degree", Y2024),
        refuse(
            "training.data_parallel_type",
            Y2024,
            "titan picks DDP from the degrees: set"
            " parallelism.data_parallel_replicate_degree N and data_parallel_shard_degree 1",
            "fsdp",
        ),
        negate("training.enable_loss_parallel", "parallelism.disable_loss_parallel", Y2024),
        refuse("parallelism.enable_compiled_autograd", f"{Y2024}–{V02}", "compiled autograd is not in titan", False),
        refuse("experimental.enable_compiled_autograd", Y2024, "compiled autograd is not in titan", False),
        refuse(
            "parallelism.pipeline_parallel_split_points",
            f"{Y2024}–{V010}",
            "titan splits the layers by count: set parallelism.pipeline_parallel_layers_per_stage",
            [],
        ),
        refuse(
            "experimental.pipeline_parallel_split_points",
            Y2024,
            "titan splits the layers by count: set parallelism.pipeline_parallel_layers_per_stage",
            [],
        ),
        refuse(
            "parallelism.pipeline_parallel_microbatches",
            Y2024,
            "titan sets the micro-batch size: use"
            " parallelism.pipeline_parallel_microbatch_size (local_batch_size / micro-batches)",
        ),
        refuse(
            "experimental.pipeline_parallel_microbatches",
            Y2024,
            "titan sets the micro-batch size: use"
            " parallelism.pipeline_parallel_microbatch_size (local_batch_size / micro-batches)",
        ),
        refuse(
            "experimental.pipeline_parallel_split_mode",
            Y2024,
            "titan builds each stage from the model (the manual split); the tracer front end is not implemented",
            "manual",
        ),
        refuse("experimental.torch_spmd", Y2024, "torch SPMD is not in titan", False),
        mapped(
            "parallelism.pipeline_parallel_layers_per_stage",
            "parallelism.pipeline_parallel_layers_per_stage",
            f"{V010}–{V02}",
            layers_per_stage,
        ),
        mapped(
            "parallelism.pipeline_parallel_schedule_csv",
            "parallelism.pipeline_parallel_schedule_csv",
            f"{Y2024}–{V02}",
            optional_str("parallelism.pipeline_parallel_schedule_csv"),
        ),
        refuse(
            "parallelism.context_parallel_load_balancer",
            V02,
            "titan always balances context-parallel shards head-tail",
            "headtail",
        ),
        refuse("parallelism.expert_parallel_comm_backend", V02, _DEEPEP, "standard"),
        no_effect("parallelism.pipeline_parallel_expert_parallel_overlap", V02, _DUALPIPE),
        # ---- checkpoint
        rename("checkpoint.enable_checkpoint", "checkpoint.enable", f"{Y2024}–{V010}"),
        rename("checkpoint.model_weights_only", "checkpoint.last_save_model_only", Y2024),
        rename("checkpoint.last_save_model_weights_only", "checkpoint.last_save_model_only", V010),
        rename("checkpoint.initial_load_model_weights_only", "checkpoint.initial_load_model_only", V010),
        rename("checkpoint.last_save_in_safetensors_format", "checkpoint.last_save_in_hf", V010),
        mapped(
            "checkpoint.initial_load_path",
            "checkpoint.initial_load_path",
            f"{V010}–{V02}",
            optional_str("checkpoint.initial_load_path"),
        ),
        refuse("checkpoint.interval_type", Y2024, "titan checkpoints every checkpoint.interval steps", "steps", "step"),
        no_effect(
            "checkpoint.enable_ft_dataloader_checkpoints",
            V02,
            "titan always saves each replica group's loader position in that group's own checkpoints",
        ),
        refuse("checkpoint.initial_load_in_hf_quantized", V02, "titan reads unquantized Hugging Face weights", False),
        refuse(
            "checkpoint.enable_first_step_checkpoint",
            f"{V010}–{V02}",
            "titan saves every checkpoint.interval"
            " steps and at the end; checkpoint.create_seed_checkpoint writes step 0",
            False,
        ),
        refuse(
            "checkpoint.load_only",
            V02,
            "titan saves whenever checkpoint.enable is on; to start from weights"
            " without saving, use checkpoint.initial_load_path and a large checkpoint.interval",
            False,
        ),
        # ---- activation checkpointing / compile
        mapped(
            "activation_checkpoint.selective_ac_option",
            "activation_checkpoint.selective_ac_option",
            f"{Y2024}–{V02}",
            selective_option,
        ),
        refuse("compile.backend", V02, "titan compiles with inductor", "inductor"),
        # ---- comm / estimation
        refuse("comm.save_traces_file_prefix", V02, "titan names the flight-recorder dumps rank_<r>", "rank_"),
        mapped("comm.mode", "job.dry_run", V02, comm_mode),
        refuse(
            "memory_estimation.enable",
            V02,
            "use --job.dry_run (per-rank memory of any layout) or scripts/estimate_memory.py",
            False,
        ),
        refuse(
            "memory_estimation.enabled",
            f"{Y2024}–{V010}",
            "use --job.dry_run (per-rank memory of any layout) or scripts/estimate_memory.py",
            False,
        ),
        no_effect("memory_estimation.disable_fake_mode", f"{Y2024}–{V02}", "read only by memory_estimation.enable"),
        refuse("estimate.memory", Y2024, "use --job.dry_run or scripts/estimate_memory.py", False),
        no_effect("estimate.mode", Y2024, "read only by estimate.memory"),
    ]
    # ---- float8: [float8] (2024, v0.1.0), [quantize.linear.float8] (v0.2.x), 2024's [training] keys
    for name in _FLOAT8_SECTION:
        r.append(rename(f"quantize.linear.float8.{name}", f"float8.{name}", V02))
    r += [
        mapped("float8.recipe_name", "float8.recipe", V010, recipe("float8.recipe_name")),
        mapped(
            "quantize.linear.float8.recipe_name", "float8.recipe", V02, recipe("quantize.linear.float8.recipe_name")
        ),
        refuse(
            "float8.force_recompute_fp8_weight_in_bwd",
            V010,
            "titan keeps the float8 weights for backward (no forced recompute)",
            False,
        ),
        refuse("float8.moe_fqns_prototype", V010, _F8_MOE, []),
        rename("training.fp8_linear", "float8.enable_float8_linear", Y2024),
        rename("training.enable_fp8_linear", "float8.enable_float8_linear", Y2024),
        rename("training.enable_float8_linear", "float8.enable_float8_linear", Y2024),
        rename("training.enable_fsdp_fp8_all_gather", "float8.enable_fsdp_float8_all_gather", Y2024),
        rename("training.enable_fsdp_float8_all_gather", "float8.enable_fsdp_float8_all_gather", Y2024),
        rename(
            "training.precompute_float8_dynamic_scale_for_fsdp",
            "float8.precompute_float8_dynamic_scale_for_fsdp",
            Y2024,
        ),
    ]
    delayed = "titan's float8 scales are dynamic (torchao removed delayed scaling)"
    for name in ("input", "weight", "grad_output"):
        r.append(refuse(f"float8.scaling_type_{name}", Y2024, delayed, "dynamic"))
        r.append(refuse(f"training.float8_scaling_type_{name}", Y2024, delayed, "dynamic"))
    for key in (
        "quantize.linear.mx.recipe_name",
        "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice",
        "quantize.linear.mx.filter_fqns",
        "mx.recipe_name",
        "mx.use_fp8_dim1_cast_triton_kernel",
        "mx.filter_fqns",
    ):
        r.append(
            no_effect(
                key,
                V02 if key.startswith("quantize") else V010,
                f"read only by the mx converter, which titan does not implement ({_MX})",
            )
        )
    r.append(rename("quantize.grouped_mm.float8.fqns", "float8.grouped_mm_fqns", V02))
    # Read only by the "quantize.grouped_mm.mx" converter, which model.converters refuses.
    r.append(no_effect("quantize.grouped_mm.mx.fqns", V02, _MX_MOE))
    r.append(no_effect("quantize.grouped_mm.mx.recipe_name", V02, _MX_MOE))
    # ---- the 2024 [experimental] / [training] parallelism keys now under [parallelism]
    for name in (
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "tensor_parallel_degree",
        "disable_loss_parallel",
        "fsdp_reshard_after_forward",
        "pipeline_parallel_degree",
    ):
        r.append(rename(f"training.{name}", f"parallelism.{name}", Y2024))
    for name in (
        "pipeline_parallel_degree",
        "pipeline_parallel_schedule",
        "context_parallel_degree",
        "context_parallel_rotate_method",
        "enable_async_tensor_parallel",
    ):
        r.append(rename(f"experimental.{name}", f"parallelism.{name}", Y2024))
    r.append(
        mapped(
            "experimental.pipeline_parallel_schedule_csv",
            "parallelism.pipeline_parallel_schedule_csv",
            Y2024,
            optional_str("parallelism.pipeline_parallel_schedule_csv"),
        )
    )
    return r


RULES: Mapping[str, Rule] = MappingProxyType({rule.key: rule for rule in _rules()})
