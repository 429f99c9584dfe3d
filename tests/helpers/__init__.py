"""Shared test helpers: the tiny model and configs (tiny), the multi-process runner (distributed)."""
