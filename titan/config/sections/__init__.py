"""One module per TOML section; titan/config/job_config.py assembles them into JobConfig."""
