"""--help SECTION, did-you-mean across sections, and the merged config written as TOML."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import tomllib

from titan.config import JobConfig, format_help, load_config, save_config, to_toml
from titan.config.manager import _flatten_toml, _set, section_fields, sections
from titan.errors import TitanError

REPO = Path(__file__).resolve().parents[3]
# Text a TOML writer must escape: quotes, backslashes, control characters, non-ASCII, a newline.
AWKWARD = 'a "quoted" C:\\path\tü \u2603\nline2 # not a comment'


def _other_value(tp, default):
    """A value of type ``tp`` that differs from ``default`` (and is awkward to write)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _other_value(args[-1], default if type(default) is args[-1] else None)
    if origin is typing.Literal:
        return next(c for c in reversed(typing.get_args(tp)) if c != default)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if typing.get_origin(inner) is typing.Literal:
            return list(reversed(typing.get_args(inner)))
        if typing.get_origin(inner) is list:
            return [_other_value(inner, []), ["y"]]
        if dataclasses.is_dataclass(inner):  # an array of tables: two tables, every field set
            hints = typing.get_type_hints(inner)
            fields = dataclasses.fields(inner)
            one = inner(**{f.name: _other_value(hints[f.name], getattr(inner(), f.name)) for f in fields})
            return [one, inner()]
        return [AWKWARD, "", "x,y"]
    if tp is bool:
        return not default
    if tp is int:
        return (default or 0) - 7
    if tp is float:
        return (default or 0.0) * 3 + 1.25e-7
    if tp is str:
        return AWKWARD + str(default)
    raise AssertionError(f"a new option type {tp}: teach to_toml and this test about it")


def _load_without_checks(text: str) -> JobConfig:
    """What load_config does with a TOML file, minus JobConfig.validate (the values are nonsense)."""
    config = JobConfig()
    for key, value in _flatten_toml(tomllib.loads(text), "dump.toml"):
        _set(config, key, value, from_cli=False)
    return config


def test_every_field_type_round_trips():
    """Every option set to a non-default value (strings with quotes, backslashes, tabs,
    newlines and non-ASCII; negative ints; floats that need all their digits; lists) loads
    back from the TOML to exactly the same config."""
    config = JobConfig()
    for section, cls in sections().items():
        body = getattr(config, section)
        for name, tp in section_fields(cls).items():
            if (section, name) != ("job", "config_file"):  # comes from the command line only
                setattr(body, name, _other_value(tp, getattr(body, name)))
    assert _load_without_checks(to_toml(config)) == config


@pytest.mark.parametrize("value", ["op", 2, "2"])
def test_int_or_str_option_keeps_its_type(value):
    config = JobConfig()
    config.activation_checkpoint.selective_ac_option = value
    assert _load_without_checks(to_toml(config)).activation_checkpoint.selective_ac_option == value


def test_options_that_can_be_none_default_to_none():
    """TOML has no null: to_toml leaves None out, which only repeats the run if None is the default."""
    for section, cls in sections().items():
        defaults = cls()
        for name, tp in section_fields(cls).items():
            if type(None) in typing.get_args(tp):
                assert getattr(defaults, name) is None, f"{section}.{name}: a None value could not be written"


def test_dumped_config_repeats_the_run(tmp_path):
    argv = [
        "--job.config_file",
        str(REPO / "train_configs/debug_model.toml"),
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--optimizer.lr",
        "1.5e-3",
        "--training.seed",
        "7",
        "--checkpoint.exclude_from_loading",
        "dataloader,lr_scheduler",
    ]
    config = load_config(argv)
    path = save_config(config)
    assert path == str(tmp_path / "run" / "config.toml")
    assert os.listdir(tmp_path / "run") == ["config.toml"]  # written via a temporary file, renamed
    again = load_config(["--job.config_file", path])
    assert again.job.config_file == path
    assert dataclasses.replace(again, job=dataclasses.replace(again.job, config_file=config.job.config_file)) == config


def test_save_config_unwritable_folder_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TitanError, match=r"job.dump_folder '.*file': cannot write config.toml"):
        save_config(JobConfig(), str(blocker))


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("training.lr", "did you mean 'optimizer.lr'?"),  # the name exists in another section
        ("training.warmup_step", "did you mean 'lr_scheduler.warmup_steps' or 'profiling.warmup_steps'?"),
        ("training.stepz", "did you mean 'training.steps'?"),  # a tie with validation.steps: the section typed
        ("checkpoint.keep_latest", "did you mean 'checkpoint.keep_latest_k'?"),
        ("job.steps", "did you mean 'training.steps' or 'validation.steps'?"),
        ("model.qqqqq", "valid in [model]: name, flavor"),
    ],
)
def test_did_you_mean_looks_at_every_section(key, suggestion):
    with pytest.raises(TitanError) as e:
        load_config([f"--{key}", "1"])
    assert str(e.value).startswith(f"unknown config key '{key}'; ")
    assert suggestion in str(e.value)


def test_help_for_one_section_or_option():
    text = format_help("checkpoint")
    assert text.startswith("[checkpoint]\n")
    assert "--checkpoint.keep_latest_k" in text and "--training." not in text
    one = format_help("checkpoint.folder")
    assert "--checkpoint.folder" in one and "--checkpoint.enable" not in one
    with pytest.raises(TitanError, match="unknown config section 'chekpoint'; did you mean 'checkpoint'"):
        format_help("chekpoint")
    with pytest.raises(TitanError, match="did you mean 'checkpoint.folder'"):
        format_help("checkpoint.foldr")
    assert "--help SECTION" in format_help() or "--help [SECTION" in format_help()


@pytest.mark.parametrize("entry", [["train.py"], ["-m", "titan.train"]])
def test_entry_points_help(entry):
    run = subprocess.run(
        [sys.executable, *entry, "--help", "checkpoint"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("[checkpoint]") and "--training.steps" not in run.stdout
    bad = subprocess.run(
        [sys.executable, *entry, "--help", "chekpoint"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == "titan: error: --help: unknown config section 'chekpoint'; did you mean 'checkpoint'?"
