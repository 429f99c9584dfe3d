"""The one validation pass over a loaded config, run before any process group or model exists.

titan.config.load_config checks types, choices and ranges: what the config knows by itself. The
checks that need runtime knowledge live in the module that owns each feature (optimizer names,
lr schedule, stability, profiling, validation, comm, pipeline schedules, the model registry,
activation checkpointing, float8); ``validate_job`` runs them all, in one place, so every user
error is one line naming the key, raised in seconds. ``load_job`` is the pair every caller needs.
"""

from __future__ import annotations

from titan.config import JobConfig, load_config


def validate_job(config: JobConfig) -> None:
    """Raise TitanError naming the first key that the owning feature rejects."""
    # Imported here, not at the top: load_job's parse errors (a typo'd flag) then fail before
    # torch is imported, in milliseconds instead of seconds.
    from titan.models import get_model_spec, model_args_from_config
    from titan.parallel.ac import parse_selective_option
    from titan.parallel.comm import validate_comm_config
    from titan.parallel.float8 import validate_float8
    from titan.parallel.pp import check_schedule_config
    from titan.training.lr_scheduler import validate_lr_scheduler_config
    from titan.training.optim import validate_optimizer_config
    from titan.training.profiling import validate_profiling_config
    from titan.training.stability import validate_stability_config
    from titan.training.validator import validate_validation_config

    validate_optimizer_config(config.optimizer)
    validate_lr_scheduler_config(config.lr_scheduler)
    validate_stability_config(config)
    validate_profiling_config(config)
    validate_validation_config(config)
    validate_comm_config(config)
    check_schedule_config(config.parallelism, config.training.local_batch_size)
    model_args_from_config(get_model_spec(config.model.name), config.model)
    if config.activation_checkpoint.mode == "selective":
        parse_selective_option(config.activation_checkpoint.selective_ac_option)
    validate_float8(config.float8)


def load_job(argv: list[str] | None = None, *, env: dict[str, str] | None = None) -> JobConfig:
    """load_config (defaults <- TOML <- CLI, config-only checks), then validate_job."""
    config = load_config(argv, env=env)
    validate_job(config)
    return config
