"""The shipped Llama 3.1 8B presets: one base (train_configs/llama3_8b.toml) and variants that are
short files on top of it (extends), each the base plus its own lines, each laid out by the dry run
for the world it is written for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from titan.config import load_config
from titan.config.compose import load_toml
from titan.tools.dry_run import run_dry_run

REPO = Path(__file__).resolve().parents[3]
CONFIGS = REPO / "train_configs"
BASE = "llama3_8b.toml"
# variant -> (ranks it is written for, its layout, a transform its plan must name)
VARIANTS = {
    "llama3_8b_float8.toml": (8, {"dp_shard": 8, "cp": 1, "dp_replicate": 1}, "float8 on 224 Linear layers"),
    "llama3_8b_long_context.toml": (8, {"dp_shard": 2, "cp": 4, "dp_replicate": 1}, "activation checkpointing full"),
    "llama3_8b_64gpu.toml": (64, {"dp_shard": 8, "cp": 1, "dp_replicate": 8}, "activation checkpointing selective"),
}


def _load(name: str, *cli: str):
    return load_config(["--job.config_file", str(CONFIGS / name), *cli])


def _without_file(config):
    return dataclasses.replace(config, job=dataclasses.replace(config.job, config_file=""))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_variant_is_the_base_plus_its_own_lines(variant):
    data = load_toml(str(CONFIGS / variant))
    assert data.pop("extends") == BASE
    own = [(f"{s}.{k}", v) for s, body in data.items() for k, v in body.items()]
    assert 0 < len(own) <= 4, own  # a short file: what makes it a variant, nothing repeated
    cli = [a for key, value in own for a in (f"--{key}", str(value).lower() if isinstance(value, bool) else str(value))]
    assert _without_file(_load(variant)) == _without_file(_load(BASE, *cli))
    base = _load(BASE)
    for key, _ in own:  # and each of its lines changes something
        section, _, name = key.partition(".")
        assert getattr(getattr(base, section), name) != getattr(getattr(_load(variant), section), name), key


@pytest.mark.slow
def test_each_variant_dry_runs_on_its_world():
    """(The base is the first variant minus float8, so its layout is checked through it.)"""
    for name, (world, degrees, transform) in VARIANTS.items():
        config = _load(name, "--job.dry_run", "--job.dry_run_world_size", str(world))
        report = run_dry_run(config)
        assert report.ok and report.model_params == 8_030_261_248, name
        assert report.degrees == {"pp": 1, "tp": 1, **degrees} and transform in report.transforms, (name, report)
