"""Every torchtitan key is classified (same key in titan, translated, or refused with its reason),
refusals say exactly that, and torchtitan's command-line spellings (tyro's, argparse's) parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan.config import load_config, to_dict
from titan.config.dialect_keys import SAME_KEYS
from titan.config.dialect_rules import RULES
from titan.config.manager import titan_keys
from titan.errors import TitanError


@pytest.mark.parametrize("key", sorted(SAME_KEYS))
def test_same_keys_are_titan_keys(key: str) -> None:
    assert key in titan_keys()


@pytest.mark.parametrize("key", sorted(k for k, r in RULES.items() if not r.refused))
def test_translations_name_an_existing_titan_key(key: str) -> None:
    assert RULES[key].to in titan_keys()


def test_no_key_is_both_same_and_translated() -> None:
    overlap = set(SAME_KEYS) & {k for k in RULES if k not in titan_keys()}
    assert not overlap


REFUSED = sorted(k for k, r in RULES.items() if r.refused and not r.any_value_is_neutral)


@pytest.mark.parametrize("key", REFUSED)
def test_refused_key_with_an_effect_stops_with_its_reason(tmp_path: Path, key: str) -> None:
    # A value torchtitan would act on (not one of the neutral values).
    with pytest.raises(TitanError) as e:
        load_config([f"--{key}", "something_else"])
    assert str(e.value) == f"torchtitan key '{key}' is not supported by titan: {RULES[key].why}"


@pytest.mark.parametrize(
    "key", sorted(k for k, r in RULES.items() if r.refused and (r.neutral or r.any_value_is_neutral))
)
def test_neutral_values_are_accepted_with_a_note(tmp_path: Path, key: str) -> None:
    rule = RULES[key]
    value = rule.neutral[0] if rule.neutral else 3
    section, _, name = key.rpartition(".")
    text = f"[{section}]\n{name} = {_toml(value)}\n" if value is not None else f"[{section}]\n"
    path = tmp_path / "c.toml"
    path.write_text(text)
    config = load_config(["--job.config_file", str(path)])
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    got, plain = to_dict(config), to_dict(load_config(["--job.config_file", str(empty)]))
    got["job"].pop("config_file"), plain["job"].pop("config_file")
    assert got == plain
    if value is not None:
        # the note waits on the config for the run's logger (titan.config.dialects.log_translations)
        assert f"torchtitan key '{key}' = {value!r} does nothing in titan ({rule.why}); ignored" in config.translations


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value).replace("'", '"')


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--model.converters", "mx"],
            "torchtitan key 'model.converters' is not supported by titan: 'mx' is not"
            " implemented; MX (microscaling) formats are not in titan; float8 linears and float8 grouped GEMMs (MoE)"
            " are",
        ),
        (
            ["--float8.recipe_name", "rowwise_with_gw_hp"],
            "torchtitan key 'float8.recipe_name' is not supported by titan:"
            " 'rowwise_with_gw_hp' is not implemented; titan's float8 recipes are tensorwise and rowwise",
        ),
        (
            ["--comm.mode", "local_tensor"],
            "torchtitan key 'comm.mode' is not supported by titan: 'local_tensor' is not"
            " implemented; --job.dry_run checks a layout on one process (fake_backend)",
        ),
        (
            ["--no-compile.enable"],
            "'--no-compile.enable' is not an option; a false boolean is --compile.enable false"
            " (or tyro's --compile.no-enable)",
        ),
    ],
)
def test_value_refusals(argv: list[str], line: str) -> None:
    with pytest.raises(TitanError) as e:
        load_config(argv)
    assert str(e.value) == line


@pytest.mark.parametrize(
    "argv, native",
    [
        (["--compile.no-enable"], ["--compile.enable", "false"]),
        (["--compile.no_enable"], ["--compile.enable", "false"]),
        (["--checkpoint.no_initial_load_model_only"], ["--checkpoint.initial_load_model_only", "false"]),
        (
            ["--checkpoint.enable", "--checkpoint.no-initial-load-model-only"],
            ["--checkpoint.enable", "--checkpoint.initial_load_model_only=false"],
        ),
        (["--job.config-file=train_configs/debug_model.toml"], ["--job.config_file", "train_configs/debug_model.toml"]),
        (
            ["--training.local-batch-size", "3", "--training.seq-len=64"],
            ["--training.local_batch_size=3", "--training.seq_len", "64"],
        ),
        (
            ["--parallelism.data_parallel_shard_degree=1", "--parallelism.data_parallel_replicate_degree=4"],
            ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "4"],
        ),
        (
            [
                "--training.dataloader.num_workers",
                "2",
                "--training.dataloader.pin_memory",
                "--training.dataloader.persistent_workers",
                "--training.dataloader.prefetch_factor",
                "4",
            ],
            [
                "--training.dataloader_num_workers",
                "2",
                "--training.dataloader_pin_memory",
                "--training.dataloader_prefetch_factor",
                "4",
            ],
        ),
        (["--training.dataloader.no-pin-memory"], ["--training.dataloader_pin_memory", "false"]),
        (
            [
                "--model.converters",
                "quantize.linear.float8",
                "--quantize.linear.float8.enable_fsdp_float8_all_gather",
                "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
                "--quantize.linear.float8.emulate",
            ],
            [
                "--float8.enable_float8_linear",
                "--float8.enable_fsdp_float8_all_gather",
                "--float8.filter_fqns",
                "[]",
                "--float8.precompute_float8_dynamic_scale_for_fsdp",
                "--float8.emulate",
            ],
        ),
        (
            ["--model.flavor=debugmodel_flex_attn", "--activation_checkpoint.mode=full"],
            [
                "--model.flavor",
                "debugmodel",
                "--model.attn_type",
                "flex",
                "--model.attn_mask_type",
                "block_causal",
                "--activation_checkpoint.mode",
                "full",
            ],
        ),
        (
            ["--model.flavor", "8B_varlen"],
            ["--model.flavor", "8B", "--model.attn_type", "varlen", "--model.attn_mask_type", "block_causal"],
        ),
        (["--debug.seed", "3", "--debug.deterministic"], ["--training.seed", "3", "--training.deterministic"]),
    ],
)
def test_cli_forms(argv: list[str], native: list[str]) -> None:
    assert to_dict(load_config(argv)) == to_dict(load_config(native))
