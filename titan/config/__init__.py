"""Configuration: dataclasses (job_config), TOML + CLI loading (manager), checks (validate)."""

from titan.config.job_config import JobConfig
from titan.config.manager import format_help, load_config, to_dict

__all__ = ["JobConfig", "format_help", "load_config", "to_dict"]
