"""torchtitan v0.2.2's three llama4 training configs, as that release ships them
(torchtitan/models/llama4/train_configs/), through the dry run at their rank counts: 8 ranks for
the debug model, 64 for 17bx16e (TP 8 x FSDP 8, experts TP-sharded) and 17bx128e (PP 4 x TP 8 x
FSDP 2). Only the tokenizer location is missing here (the dry run then uses the flavor's
vocabulary) and the debug model's c4_test is titan's offline corpus. The debug model also trains,
at EP 2 on 2 CPU ranks in its bfloat16 parameters, from a folder laid out as torchtitan's
repository (its tokenizer folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from titan.config import load_config
from titan.errors import TitanError
from titan.launch.entry import main
from titan.parallel.float8 import check_float8_grouped_mm

CONFIGS = {
    "debug_model": """\
[job]
dump_folder = "./outputs"
description = "Llama 4 debug training"
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
name = "llama4"
flavor = "debugmodel"
# test tokenizer.model, for debug purpose only
hf_assets_path = "./tests/assets/tokenizer"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 4e-3
eps = 1e-15

[lr_scheduler]
warmup_steps = 2  # lr scheduler warm up, normally 20% of the train steps
decay_ratio = 0.8  # lr scheduler decay ratio, 80% of the train steps
decay_type = "linear"
min_lr_factor = 0.1

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
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "1F1B"
context_parallel_degree = 1
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
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = 'op'  # 'int' = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output", "router.gate"]

[quantize.grouped_mm.float8]
fqns = ["experts"]

[quantize.linear.mx]
filter_fqns = ["output", "router.gate"]

[quantize.grouped_mm.mx]
fqns = ["experts"]
""",
    "llama4_17bx16e": """\
# NOTE: this toml config is a preset for 64 H100 GPUs.

[job]
dump_folder = "./outputs"
description = "Llama 4 Scout 17Bx16E training"

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "llama4"
flavor = "17bx16e"
hf_assets_path = "./assets/hf/Llama-4-Scout-17B-16E"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 4e-3
eps = 1e-15

[lr_scheduler]
warmup_steps = 600
min_lr_factor = 0.1

[training]
local_batch_size = 8
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 3000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
context_parallel_degree = 1
expert_parallel_degree = 1
expert_tensor_parallel_degree = 8

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "full" # ["none", "selective", "full"]

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output", "router.gate"]

[quantize.linear.mx]
filter_fqns = ["output", "router.gate"]
""",
    "llama4_17bx128e": """\
# TODO: this toml config is still under development

[job]
dump_folder = "./outputs"
description = "Llama 4 Maverick 17Bx128E training"

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "llama4"
flavor = "17bx128e"
hf_assets_path = "./assets/hf/Llama-4-Maverick-17B-128E"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 4e-3
eps = 1e-15

[lr_scheduler]
warmup_steps = 600
min_lr_factor = 0.1

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 3000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
enable_async_tensor_parallel = false
pipeline_parallel_degree = 4
# pipeline_parallel_schedule = "interleaved1f1b"
# pipeline_parallel_microbatches = 2
context_parallel_degree = 1
expert_parallel_degree = 1
expert_tensor_parallel_degree = 8

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "full" # ["none", "selective", "full"]

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output", "router.gate"]

[quantize.linear.mx]
filter_fqns = ["output", "router.gate"]
""",
}
RANKS = {"debug_model": 8, "llama4_17bx16e": 64, "llama4_17bx128e": 64}
# torch's 1F1B schedule needs at least as many micro-batches as stages; the file's local batch of
# 1 gives 1 for 4 stages, which torch refuses in torchtitan too. With 4 sequences per rank it plans.
PP_MICROBATCHES = "pipeline schedule 1F1B rejects 1 micro-batches"


def _dry_run(tmp_path: Path, name: str, *extra: str) -> tuple[int, list[str], str]:
    path = tmp_path / f"{name}.toml"
    path.write_text(CONFIGS[name])
    flags = ["--job.config_file", str(path), "--job.dump_folder", str(tmp_path / "out"), *extra]
    return main([*flags, "--job.dry_run", "--job.dry_run_world_size", str(RANKS[name])]), flags, name


@pytest.mark.parametrize("name", ["debug_model", "llama4_17bx16e"])
def test_llama4_config_dry_runs_as_it_is(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status, _, _ = _dry_run(tmp_path, name)
    out = capsys.readouterr()
    assert status == 0, out.err.strip().splitlines()[-1:]
    assert "matches the model's" in out.out + out.err


def test_llama4_17bx128e_dry_runs_with_enough_microbatches(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status, _, _ = _dry_run(tmp_path, "llama4_17bx128e")
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and PP_MICROBATCHES in err[-1], err[-1:]
    status, _, _ = _dry_run(tmp_path, "llama4_17bx128e", "--training.local_batch_size", "4")
    out = capsys.readouterr()
    assert status == 0, out.err.strip().splitlines()[-1:]
    assert "matches the model's" in out.out + out.err


def test_grouped_mm_float8_and_mx_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The debug config's grouped-GEMM fqns take effect with torchtitan's converter: float8 on CUDA,
    refused on CPU ranks in one line; MX is refused (Blackwell only, not in titan)."""
    convert = ("--model.converters", "quantize.grouped_mm.float8")
    status, _, _ = _dry_run(tmp_path, "debug_model", *convert)
    assert status == 0, capsys.readouterr().err.strip().splitlines()[-1:]
    capsys.readouterr()
    path = tmp_path / "cpu.toml"
    path.write_text(CONFIGS["debug_model"])
    f8 = load_config(["--job.config_file", str(path), *convert]).float8
    assert f8.enable_float8_grouped_mm and f8.grouped_mm_fqns == ["experts"]
    with pytest.raises(TitanError, match=r"needs CUDA SM89\+ \(torchao's scaled grouped GEMM has no CPU kernel"):
        check_float8_grouped_mm(f8, "cpu", 1, 1)
    status = main(["--job.config_file", str(path), "--model.converters", "quantize.grouped_mm.mx", "--job.dry_run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and "MX (microscaling)" in err[-1], err[-1:]


def test_moe_benchmark_presets_are_valid_configs() -> None:
    """scripts/benchmark.py's MoE rows: each variant loads and checks as the layout it names."""
    import importlib.util

    from titan.training.checks import load_job
    from titan.training.plan import plan_run

    path = Path(__file__).resolve().parents[2] / "scripts/benchmark.py"
    spec = importlib.util.spec_from_file_location("benchmark", path)
    assert spec is not None and spec.loader is not None
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    for name, world in (("moe_debug_cpu", 2), ("llama4_17bx16e_4layers", 8)):
        preset = benchmark.PRESETS[name]
        for _, extra in preset["variants"]:
            config = load_job(preset.get("args", []) + extra.format(nproc=world).split())
            plan = plan_run(config, world, "cuda" if world == 8 else "cpu")
            assert plan.parallel_dims.ep == config.parallelism.expert_parallel_degree


def test_ep_with_per_op_selective_ac_plans_at_the_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The debug config's per-op selective AC with EP 2 and EP 8 (the file's AC as shipped)."""
    for ep in ("2", "8"):
        status, _, _ = _dry_run(tmp_path, "debug_model", "--parallelism.expert_parallel_degree", ep)
        assert status == 0, capsys.readouterr().err.strip().splitlines()[-1:]


def _debug_model_at_ep2(rank: int, world: int, folder: str) -> dict[int, float]:
    from titan.training.trainer import Trainer

    os.chdir(folder)  # the file's relative paths: ./tests/assets/tokenizer, ./outputs
    flags = [
        *("--job.config_file", "debug_model.toml", "--parallelism.expert_parallel_degree", "2"),
        # The file's per-op selective AC: each block's recompute replays its experts' FSDP unit.
        "--training.steps",
        "20",
        # 8 x 64 tokens per rank instead of 8 x 2048, for time: 64 per expert on average, and the
        # busiest expert's load grows to 4-5x the mean within 10 steps: over 256 tokens, where
        # counts in bfloat16 would stop being exact.
        *("--training.seq_len", "64", "--metrics.log_freq", "5"),
    ]
    config = load_config(flags)
    assert config.training.mixed_precision_param == "bfloat16"  # the file's (torchtitan's) default
    return Trainer(config).train()


@pytest.mark.slow
def test_debug_model_trains_at_ep2_in_bf16_on_two_ranks(tmp_path: Path) -> None:
    (tmp_path / "debug_model.toml").write_text(CONFIGS["debug_model"])
    tokenizer = tmp_path / "tests/assets/tokenizer"
    tokenizer.mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parents[2] / "titan/data/assets/tokenizer.model", tokenizer)
    for losses in run_distributed(_debug_model_at_ep2, 2, str(tmp_path), timeout=600):
        assert sorted(losses) == [1, 5, 10, 15, 20], losses
        assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
        assert losses[20] < losses[1] - 0.5, losses
