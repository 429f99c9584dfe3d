"""Configuration, the ground floor (imports nothing from titan but errors): dataclasses
(job_config, one section per module in sections/, each with its own validate()), fixed choices as
Literal types (choices), TOML + CLI loading with type and choice checks that ends in
JobConfig.validate (manager), --help and the TOML dump (output). The checks that need runtime
knowledge run in titan.training.checks.validate_job; titan.training.checks.load_job does both."""

from titan.config.job_config import JobConfig
from titan.config.manager import load_config, to_dict
from titan.config.output import format_help, save_config, to_toml

__all__ = ["JobConfig", "format_help", "load_config", "save_config", "to_dict", "to_toml"]
