"""Configuration: dataclasses (job_config), TOML + CLI loading (manager), checks (validate),
--help and the TOML dump (output)."""

from titan.config.job_config import JobConfig
from titan.config.manager import load_config, to_dict
from titan.config.output import format_help, save_config, to_toml

__all__ = ["JobConfig", "format_help", "load_config", "save_config", "to_dict", "to_toml"]
