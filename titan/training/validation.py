"""The config's runtime checks: what the features that own a key reject (the model registry and its
flavors and shapes, the optimizer table, torch's pipeline schedules). The run plan
(titan/training/plan.py) and the one pre-process-group check (titan/training/checks.py) run them."""

from __future__ import annotations

from titan.config import JobConfig, load_config


def validate_job(config: JobConfig) -> None:
    """Raise TitanError naming the first key that the owning feature rejects."""
    # Imported here, not at the top: load_job's parse errors (a typo'd flag) then fail before
    # torch is imported, in milliseconds instead of seconds.
    from titan.models import get_model_spec, model_args_from_config
    from titan.parallel.pp_layout import check_schedule_config
    from titan.training.optim import validate_optimizer_config

    validate_optimizer_config(config.optimizer)
    check_schedule_config(config.parallelism, evaluates=config.validation.enable)
    model_args_from_config(get_model_spec(config.model.name), config.model)


def load_job(argv: list[str] | None = None, *, env: dict[str, str] | None = None) -> JobConfig:
    """load_config (defaults <- TOML <- CLI, JobConfig.validate), then validate_job."""
    config = load_config(argv, env=env)
    validate_job(config)
    return config
