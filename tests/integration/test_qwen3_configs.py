"""torchtitan v0.2.2's four qwen3 training configs, as that release ships them
(torchtitan/models/qwen3/train_configs/), through the dry run at 8 ranks (the rank count of
torchtitan's run_train.sh; the 32B file says 8 GPUs); the MoE debug config also trains for a few
steps on 2 CPU ranks (shorter windows: 4096-token windows of 64 experts take minutes on a CPU).
Only the tokenizer location is missing here (the dry run then uses the flavor's vocabulary) and
c4_test is titan's offline corpus."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runs import REPO, run_env
from titan.launch.entry import main

CONFIGS = {
    "qwen3_0.6b": """\
[job]
dump_folder = "./outputs"
description = "Qwen 3 0.6B training"

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 1
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "qwen3"
flavor = "0.6B"
hf_assets_path = "./assets/hf/Qwen3-0.6B"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2  # lr scheduler warm up, 20% total steps

[training]
local_batch_size = 4
seq_len = 4096
max_norm = 1.0  # grad norm clipping
steps = 10
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = false
export_dtype = "float16"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
""",
    "qwen3_1.7b": """\
[job]
dump_folder = "./outputs"
description = "Qwen 3 1.7B training"

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "qwen3"
flavor = "1.7B"
hf_assets_path = "./assets/hf/Qwen3-1.7B"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 20  # lr scheduler warm up, 20% total steps

[training]
local_batch_size = 4
seq_len = 4096
max_norm = 1.0  # grad norm clipping
steps = 100
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 50
last_save_model_only = false
export_dtype = "float16"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
""",
    "qwen3_32b": """\
# NOTE: this toml config is a preset for 8 H100 GPUs (with 96GiB memory).

[job]
dump_folder = "./outputs"
description = "Qwen3 32B training"

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "qwen3"
flavor = "32B"
hf_assets_path = "./assets/hf/Qwen3-32B"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 600  # lr scheduler warm up, 20% total steps

[training]
local_batch_size = 2
seq_len = 4096
max_norm = 1.0  # grad norm clipping
steps = 3000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default" # default / never / always
tensor_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = false
export_dtype = "float16"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "full"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
""",
    "qwen3_moe_debug": """\
[job]
dump_folder = "./outputs"
description = "Qwen 3 MoE debug model training"

[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 1
enable_tensorboard = false
save_tb_folder = "tb"

[model]
name = "qwen3"
flavor = "debugmodel_moe"
hf_assets_path = "./tests/assets/tokenizer"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2  # lr scheduler warm up, 20% total steps

[training]
local_batch_size = 4
seq_len = 4096
max_norm = 1.0  # grad norm clipping
steps = 10
dataset = "c4_test"

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
export_dtype = "float16"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[compile]
enable=false
components = ["model", "loss"]

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]
""",
}
RANKS = 8


@pytest.mark.parametrize("name", list(CONFIGS))
def test_qwen3_config_dry_runs_as_it_is(name: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / f"{name}.toml"
    path.write_text(CONFIGS[name])
    flags = ["--job.config_file", str(path), "--job.dump_folder", str(tmp_path / "out")]
    status = main([*flags, "--job.dry_run", "--job.dry_run_world_size", str(RANKS)])
    out = capsys.readouterr()
    assert status == 0, out.err.strip().splitlines()[-1:]
    flavor = re.search(r'flavor = "(.+)"', CONFIGS[name])
    assert flavor is not None
    text = out.out + out.err
    assert "matches the model's" in text and f"qwen3 {flavor[1]} on {RANKS} ranks" in text


@pytest.mark.slow
def test_qwen3_moe_debug_config_trains_on_two_cpu_ranks(tmp_path: Path) -> None:
    path = tmp_path / "qwen3_moe_debug.toml"
    path.write_text(CONFIGS["qwen3_moe_debug"])
    # The file's tokenizer folder is torchtitan's test asset; titan's shipped tokenizer stands in.
    short = [
        "--model.tokenizer_path",
        "",
        "--training.seq_len",
        "128",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        "3",
    ]
    env = run_env(NGPU="2", CONFIG_FILE=str(path))
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path / "out"), "--metrics.log_freq", "1", *short]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    losses = [float(m) for m in re.findall(r"step:\s*\d+\s+loss:\s*([0-9.]+)", text)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
