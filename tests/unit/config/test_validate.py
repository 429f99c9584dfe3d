"""Each config section checks itself (validate()), JobConfig.validate adds the rules between
sections, and load_config hands out only validated configs. Every message is one line naming the key."""

from __future__ import annotations

import dataclasses

import pytest

from titan.config import JobConfig, load_config
from titan.config.job_config import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Float8,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Stability,
    Training,
    Validation,
)
from titan.config.sections.training import MixtureSource
from titan.errors import TitanError

CASES = [
    (Job(dry_run_world_size=0), "config key 'job.dry_run_world_size' got 0; valid: an integer >= 1"),
    (Model(n_heads=0), "config key 'model.n_heads' got 0; valid: an integer >= 1, or unset for the flavor's value"),
    (
        Model(attn_type="varlen"),
        "config key 'model.attn_type' = \"varlen\" attends within each document: it needs"
        ' model.attn_mask_type = "block_causal" (for causal attention over the whole window use sdpa or flex)',
    ),
    (Optimizer(lr=0.0), "config key 'optimizer.lr' got 0.0; valid: a number > 0"),
    (Optimizer(eps=float("nan")), "config key 'optimizer.eps' got nan; valid: a number >= 0"),
    (
        Optimizer(name="Adam", bf16_stochastic_round=True),
        "config key 'optimizer.name' got 'Adam'; valid: AdamW with optimizer.bf16_stochastic_round (torchao's kernel)",
    ),
    (LRScheduler(total_steps=0), "config key 'lr_scheduler.total_steps' got 0; valid: an integer >= 1, or unset"),
    (Training(seq_len=1), "config key 'training.seq_len' got 1; valid: an integer >= 2"),
    (
        Training(dataloader_prefetch_factor=2),
        "config key 'training.dataloader_prefetch_factor' got 2; valid: unset,"
        " or an integer >= 1 together with training.dataloader_num_workers > 0",
    ),
    (
        Training(nonfinite_max_consecutive_skips=-1),
        "config key 'training.nonfinite_max_consecutive_skips' got -1; valid: an integer >= 0",
    ),
    (
        Training(mixture=[MixtureSource(path="a"), MixtureSource(path="b", weight=0.0)]),
        "config key 'training.mixture[1].weight' got 0.0; valid: a number > 0",
    ),
    (
        Parallelism(data_parallel_shard_degree=0),
        "config key 'parallelism.data_parallel_shard_degree' got 0; valid: -1 (the rest) or an integer >= 1",
    ),
    (
        Parallelism(pipeline_parallel_first_stage_less_layers=-1),
        "config key 'parallelism.pipeline_parallel_first_stage_less_layers' got -1; valid: an integer >= 0",
    ),
    (Metrics(param_norm_freq=-1), "config key 'metrics.param_norm_freq' got -1; valid: an integer >= 0 (0: never)"),
    (
        Checkpoint(keep_latest_k=-1),
        "config key 'checkpoint.keep_latest_k' got -1; valid: 0 (keep all) or an integer >= 1",
    ),
    (Checkpoint(load_step=3), "config key 'checkpoint.load_step' needs checkpoint.enable (add --checkpoint.enable)"),
    (
        Checkpoint(enable=True, initial_load_in_hf=True),
        "config key 'checkpoint.initial_load_in_hf' needs checkpoint.initial_load_path (the HF folder)",
    ),
    (
        Stability(loss_spike_threshold=float("inf")),
        "config key 'stability.loss_spike_threshold' got inf; valid: a finite number >= 0",
    ),
    (
        Validation(enable=True, steps=0),
        "config key 'validation.steps' got 0; valid: -1 (the whole set) or an integer >= 1",
    ),
    (
        Validation(mixture=[MixtureSource()]),
        "config key 'validation.mixture[0]' got MixtureSource(path='', dataset='', weight=1.0); valid: a table with"
        " path or dataset set",
    ),
    (
        Profiling(enable_profiling=True, profile_freq=3, warmup_steps=3),
        "config key 'profiling.profile_freq' must be >= profiling.warmup_steps + profiling.active_steps (3 + 1),"
        " the steps of one trace; got profile_freq (3)",
    ),
    (Comm(trace_buf_size=-1), "config key 'comm.trace_buf_size' got -1; valid: an integer >= 0 (0 disables)"),
    (
        ActivationCheckpoint(mode="selective", selective_ac_option="every"),
        "config key 'activation_checkpoint.selective_ac_option' got 'every'; valid: \"op\" or an integer >= 1",
    ),
    (
        Float8(enable_float8_linear=True, precompute_float8_dynamic_scale_for_fsdp=True),
        "config key 'float8.precompute_float8_dynamic_scale_for_fsdp' needs float8.enable_fsdp_float8_all_gather = true"
        " (the precomputed scales are those of the float8 all-gather)",
    ),
]


@pytest.mark.parametrize("section, message", CASES, ids=lambda c: type(c).__name__ if not isinstance(c, str) else "")
def test_each_section_rejects_a_bad_value_in_one_line(section, message):
    with pytest.raises(TitanError) as e:
        section.validate()
    assert str(e.value) == message


def test_every_section_has_validate_and_its_defaults_pass():
    config = JobConfig()
    for f in dataclasses.fields(config):
        section = getattr(config, f.name)
        assert "validate" in type(section).__dict__, f.name  # its own, not inherited
        section.validate()
    config.validate()
    # a section that validates its values only when it is on
    Validation(enable=False, steps=0).validate()
    Profiling(enable_profiling=False, profile_freq=0).validate()


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"model.attn_mask_type": "block_causal", "parallelism.context_parallel_degree": 2},
            "config key 'model.attn_mask_type' = \"block_causal\" does not combine with"
            " parallelism.context_parallel_degree 2",
        ),
        (
            {
                "checkpoint.enable": True,
                "checkpoint.last_save_in_hf": True,
                "checkpoint.last_save_model_only": True,
                "parallelism.pipeline_parallel_degree": 2,
            },
            "config key 'checkpoint.last_save_in_hf' is not supported with pipeline parallelism",
        ),
        (
            {"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_microbatch_size": 3},
            "config key 'training.local_batch_size' (8) must be a multiple of"
            " parallelism.pipeline_parallel_microbatch_size (3)",
        ),
    ],
)
def test_job_config_validate_checks_rules_between_sections(changes, message):
    config = JobConfig()
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    for key in changes:
        getattr(config, key.split(".")[0]).validate()  # each section alone is fine
    with pytest.raises(TitanError) as e:
        config.validate()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    # with the other section's key back at its default the rule holds
    section, name = list(changes)[-1].split(".")
    setattr(getattr(config, section), name, getattr(getattr(JobConfig(), section), name))
    config.validate()


def test_load_config_returns_only_validated_configs(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text("[metrics]\nlog_freq = 0\n")
    with pytest.raises(TitanError, match=r"^config key 'metrics.log_freq' got 0; valid: an integer >= 1$"):
        load_config(["--job.config_file", str(toml)])
    toml.write_text('[model]\nattn_mask_type = "block_causal"\n[parallelism]\ncontext_parallel_degree = 2\n')
    with pytest.raises(TitanError, match="does not combine with parallelism.context_parallel_degree 2"):
        load_config(["--job.config_file", str(toml)])
    # the CLI overrides the file before the checks run
    config = load_config(["--job.config_file", str(toml), "--parallelism.context_parallel_degree", "1"])
    assert config.model.attn_mask_type == "block_causal"
