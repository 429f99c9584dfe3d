"""The two validation passes: load_config checks what the config knows by itself (each section's
validate() and the rules between sections); validate_job what needs runtime knowledge (the model
registry, the optimizer table, torch's pipeline schedules). Every error is one line naming the key."""

from pathlib import Path

import pytest
import torch

from titan.config import load_config
from titan.config.choices import DType, OptimizerImplementation, WeightDecayExclude, choices
from titan.errors import TitanError
from titan.training.checks import load_job, validate_job

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizer.lr", "-1"], "config key 'optimizer.lr' got -1.0; valid: a number > 0"),
        (
            ["--lr_scheduler.min_lr_factor", "2"],
            "config key 'lr_scheduler.min_lr_factor' got 2.0; valid: a number in [0, 1]",
        ),
        (
            ["--stability.loss_spike_window", "0"],
            "config key 'stability.loss_spike_window' got 0; valid: an integer >= 1",
        ),
        (
            ["--profiling.enable_profiling", "--profiling.profile_freq", "2"],
            "must be >= profiling.warmup_steps + profiling.active_steps (3 + 1)",
        ),
        (
            ["--validation.enable", "--validation.freq", "0"],
            "config key 'validation.freq' got 0; valid: an integer >= 1",
        ),
        (
            ["--comm.train_timeout_seconds", "0"],
            "config key 'comm.train_timeout_seconds' got 0; valid: an integer >= 1",
        ),
        (
            ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"],
            "'activation_checkpoint.selective_ac_option' got 0",
        ),
        (
            ["--float8.enable_float8_linear", "--float8.recipe", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
            "config key 'float8.enable_fsdp_float8_all_gather' works only with float8.recipe = tensorwise",
        ),
    ],
)
def test_config_checks_run_in_load_config(argv, message):
    with pytest.raises(TitanError) as e:
        load_config(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizer.name", "SGD"], "config key 'optimizer.name' got 'SGD'; valid: AdamW, Adam"),
        (["--parallelism.pipeline_parallel_schedule", "2F2B"], "'parallelism.pipeline_parallel_schedule' got '2F2B'"),
        (["--model.flavor", "giant"], "config key 'model.flavor' got 'giant'; valid for llama3: debugmodel"),
        (["--model.name", "gpt9"], "config key 'model.name' got 'gpt9'; valid: llama3"),
        (["--model.n_kv_heads", "5"], "(flavor 'debugmodel' with model.n_kv_heads = 5)"),
    ],
)
def test_runtime_checks_run_in_validate_job_only(argv, message):
    config = load_config(argv)  # the config knows nothing wrong with these
    with pytest.raises(TitanError) as e:
        validate_job(config)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TitanError) as again:
        load_job(argv)
    assert str(again.value) == str(e.value)


def test_load_job_passes_the_shipped_configs():
    for path in sorted((REPO / "train_configs").glob("*.toml")):
        load_job(["--job.config_file", str(path)])


def test_trainer_validates_a_config_from_load_config_alone():
    from titan.training.trainer import Trainer

    config = load_config(["--optimizer.name", "SGD", "--training.seq_len", "32"])
    with pytest.raises(TitanError, match="config key .optimizer.name. got 'SGD'; valid: AdamW, Adam"):
        Trainer(config)


def test_runtime_tables_match_the_config_choices():
    from titan.parallel.fsdp import DTYPES
    from titan.training.optim import IMPLEMENTATIONS, WEIGHT_DECAY_EXCLUDE

    assert ("auto", *IMPLEMENTATIONS) == choices(OptimizerImplementation)  # auto: resolve_implementation
    assert tuple(WEIGHT_DECAY_EXCLUDE) == choices(WeightDecayExclude)
    assert tuple(DTYPES) == choices(DType)
    assert [DTYPES[n].itemsize for n in DTYPES] == [4, 2, 2] and DTYPES["bfloat16"] is torch.bfloat16


def test_check_entry_point_runs_the_whole_pass(capsys):
    """python -m titan.launch.check (what the launchers run first) reports a feature's error too."""
    from titan.launch.check import main

    assert main(["--optimizer.lr", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "titan: error: config key 'optimizer.lr' got -1.0; valid: a number > 0"
    assert main(["--training.seq_len", "32"]) == 0


def test_check_prints_a_merged_value_for_the_launch_scripts(capsys, tmp_path):
    """--print_value KEY: the value after TOML and flags, alone on stdout (the replica-group
    launchers place each group's folder under job.dump_folder this way)."""
    from titan.launch.check import main

    config = tmp_path / "run.toml"
    config.write_text(f'extends = "{REPO / "train_configs/debug_model.toml"}"\n[job]\ndump_folder = "/from/toml"\n')
    assert main(["--print_value", "job.dump_folder", "--job.config_file", str(config)]) == 0
    assert capsys.readouterr().out == "/from/toml\n"
    assert (
        main(["--job.config_file", str(config), "--job.dump_folder", "/cli", "--print_value", "job.dump_folder"]) == 0
    )
    assert capsys.readouterr().out == "/cli\n"
    assert main(["--print_value", "training.steps", "--training.steps", "7"]) == 0
    assert capsys.readouterr().out == "7\n"
    for argv, line in [
        (["--print_value", "job.dump_foldr"], "unknown config key 'job.dump_foldr'; did you mean 'job.dump_folder'?"),
        (["--print_value"], "--print_value needs a config key (section.key), e.g. --print_value job.dump_folder"),
    ]:
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.strip() == f"titan: error: {line}"
