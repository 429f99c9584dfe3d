"""torchtitan v0.2.2's gpt_oss training config, as that release ships it
(torchtitan/models/gpt_oss/train_configs/debug_model.toml), through the dry run at 8 ranks (FSDP 8;
the file sets no rank count), 120b at TP 8, and the layouts gpt_oss refuses, each in one line. Only the tokenizer
location is missing here (the dry run then uses the flavor's vocabulary) and c4_test is titan's
offline corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan.launch.entry import main

pytestmark = pytest.mark.slow

DEBUG_MODEL = """\
[job]
dump_folder = "./outputs"
description = "Gpt-oss debug training"
print_config = false

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"

[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb"
enable_wandb = false

[model]
name = "gpt_oss"
flavor = "debugmodel"
# test folder with tokenizer.json, for debug purpose only
hf_assets_path = "./tests/assets/tokenizer"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2  # lr scheduler warm up, normally 20% of the train steps
decay_ratio = 0.8  # lr scheduler decay ratio, 80% of the train steps
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 8
seq_len = 2048
max_norm = 1.0  # grad norm clipping
steps = 10
dataset = "c4_test"  # supported datasets: c4_test (2K), c4 (177M)

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
enable_async_tensor_parallel = false
expert_parallel_degree = 1
expert_tensor_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
last_save_model_only = false
export_dtype = "float32"
async_mode = "disabled"  # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "none"  # ["none", "selective", "full"]
selective_ac_option = '2'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable = false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output", "router.gate"]

[quantize.grouped_mm.float8]
fqns = ["experts"]

[validation]
enable = false
dataset = "c4_validation"
freq = 5
steps = 10
"""


def _dry_run(tmp_path: Path, *extra: str) -> int:
    path = tmp_path / "debug_model.toml"
    path.write_text(DEBUG_MODEL)
    flags = ["--job.config_file", str(path), "--job.dump_folder", str(tmp_path / "out"), *extra]
    return main([*flags, "--job.dry_run", "--job.dry_run_world_size", "8"])


def test_gpt_oss_debug_config_dry_runs_as_it_is_and_with_ep(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for extra in ((), ("--parallelism.expert_parallel_degree", "2")):
        status = _dry_run(tmp_path, *extra)
        out = capsys.readouterr()
        assert status == 0, out.err.strip().splitlines()[-1:]
        assert "matches the model's" in out.out + out.err


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (("--parallelism.tensor_parallel_degree", "4", "--model.n_kv_heads", "2"), "must divide model n_kv_heads (2)"),
        (("--parallelism.context_parallel_degree", "2"), "context_parallel_degree = 2 is not supported for model.name"),
    ],
)
def test_refused_layouts_say_so_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, flags, line) -> None:
    status = _dry_run(tmp_path, *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and line in err[-1], err[-1:]


def test_tp_with_compile_plans(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status = _dry_run(tmp_path, "--parallelism.tensor_parallel_degree", "2", "--compile.enable")
    out = capsys.readouterr()
    assert status == 0, out.err.strip().splitlines()[-1:]


def test_120b_plans_at_tp8(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Tensor + sequence parallel over 8 ranks: every parameter's shard is counted once (the check
    line), sinks and experts' biases included."""
    status = _dry_run(tmp_path, "--model.flavor", "120b", "--parallelism.tensor_parallel_degree", "8")
    out = capsys.readouterr()
    assert status == 0, out.err.strip().splitlines()[-1:]
    assert "dp_shard 1, cp 1, tp 8" in out.out and "matches the model's 116,829,156,672" in out.out


def test_gpt_oss_benchmark_presets_are_valid_configs() -> None:
    """scripts/benchmark.py's gpt-oss rows: each variant loads and plans as the layout it names."""
    from tests.helpers.runs import script_module
    from titan.training.checks import load_job
    from titan.training.plan import plan_run

    benchmark = script_module("benchmark")
    for name, world in (("gpt_oss_debug_cpu", 2), ("gpt_oss_20b_4layers", 8)):
        preset = benchmark.PRESETS[name]
        for _, extra in preset["variants"]:
            config = load_job(preset.get("args", []) + extra.format(nproc=world).split())
            plan = plan_run(config, world, "cuda" if world == 8 else "cpu")
            assert config.model.name == "gpt_oss"
            assert plan.parallel_dims.ep == config.parallelism.expert_parallel_degree
