"""torchtitan's TOML dialects (2024 / SageMaker guide, v0.1.0, v0.2.2) load to the same merged config
as the titan-native file that says the same thing."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from titan.config import load_config, to_dict
from titan.config.dialect_rules import RULES
from titan.config.dialects import log_translations
from titan.errors import TitanError

REPO = Path(__file__).resolve().parents[3]

# Written the way torchtitan's 2024 argparse config and the SageMaker guide spelled things.
Y2024 = """
[job]
dump_folder = "./out2024"
print_args = true
use_for_integration_test = false
[profiling]
run_profiler = false
profile_every_x_iter = 7
[metrics]
rank_0_only = true
enable_color_printing = false
[model]
name = "llama3"
flavor = "debugmodel"
norm_type = "rmsnorm"
use_flex_attn = false
[optimizer]
name = "AdamW"
lr = 3e-4
fused = true
[training]
batch_size = 4
seq_len = 64
warmup_steps = 3
steps = 9
compile = true
data_parallel_degree = 2
data_parallel_type = "fsdp"
tensor_parallel_degree = 1
enable_loss_parallel = false
fp8_linear = true
enable_float8_linear = true
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
float8_scaling_type_input = "dynamic"
[experimental]
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "GPipe"
pipeline_parallel_schedule_csv = ""
pipeline_parallel_split_points = []
pipeline_parallel_split_mode = "manual"
context_parallel_degree = 1
context_parallel_rotate_method = "alltoall"
enable_async_tensor_parallel = false
enable_compiled_autograd = false
[checkpoint]
enable_checkpoint = true
model_weights_only = true
interval_type = "steps"
interval = 3
[float8]
enable_float8_linear = true
scaling_type_weight = "dynamic"
[memory_estimation]
enabled = false
"""

Y2024_NATIVE = """
[job]
dump_folder = "./out2024"
print_config = true
[profiling]
enable_profiling = false
profile_freq = 7
[metrics]
log_rank = 0
disable_color_printing = true
[model]
name = "llama3"
flavor = "debugmodel"
attn_type = "sdpa"
[optimizer]
name = "AdamW"
lr = 3e-4
implementation = "fused"
[lr_scheduler]
warmup_steps = 3
[training]
local_batch_size = 4
seq_len = 64
steps = 9
[compile]
enable = true
[parallelism]
data_parallel_shard_degree = 2
tensor_parallel_degree = 1
disable_loss_parallel = true
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "GPipe"
pipeline_parallel_schedule_csv = ""
context_parallel_degree = 1
context_parallel_rotate_method = "alltoall"
enable_async_tensor_parallel = false
[checkpoint]
enable = true
last_save_model_only = true
interval = 3
[float8]
enable_float8_linear = true
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
"""

V010 = """
[job]
description = "v0.1.0 style"
print_args = false
[metrics]
save_for_all_ranks = true
[model]
flavor = "debugmodel_flex_attn"
tokenizer_path = "./tok/tokenizer.model"
converters = ["float8"]
print_after_conversion = false
[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "cosine"
lr_min = 0.1
[training]
local_batch_size = 2
seq_len = 128
steps = 10
compile = false
dataset = "c4_test"
gc_debug = false
debug_moe_force_load_balance = false
[parallelism]
pipeline_parallel_layers_per_stage = 2
pipeline_parallel_split_points = []
pipeline_parallel_schedule_csv = ""
enable_compiled_autograd = false
[checkpoint]
enable_checkpoint = true
last_save_model_weights_only = true
initial_load_model_weights_only = false
initial_load_path = "/somewhere/step-5"
last_save_in_safetensors_format = false
enable_first_step_checkpoint = false
[activation_checkpoint]
mode = "selective"
selective_ac_option = '2'
[float8]
recipe_name = "rowwise"
filter_fqns = ["output", "wq"]
emulate = true
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
force_recompute_fp8_weight_in_bwd = false
[mx]
recipe_name = "mxfp8"
[experimental]
custom_import = ""
custom_args_module = ""
[fault_tolerance]
enable = false
replica_id = 0
group_size = 0
[memory_estimation]
enabled = false
disable_fake_mode = false
"""

V010_NATIVE = """
[job]
description = "v0.1.0 style"
print_config = false
[metrics]
log_rank = -1
[model]
flavor = "debugmodel"
attn_type = "flex"
attn_mask_type = "block_causal"
tokenizer_path = "./tok/tokenizer.model"
[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "cosine"
min_lr_factor = 0.1
[training]
local_batch_size = 2
seq_len = 128
steps = 10
dataset = "pydoc"
[compile]
enable = false
[parallelism]
pipeline_parallel_layers_per_stage = 2
[checkpoint]
enable = true
last_save_model_only = true
initial_load_model_only = false
initial_load_path = "/somewhere/step-5"
last_save_in_hf = false
[activation_checkpoint]
mode = "selective"
selective_ac_option = 2
[float8]
enable_float8_linear = true
recipe = "rowwise"
filter_fqns = ["output", "wq"]
emulate = true
"""

V022 = """
[job]
dump_folder = "./out022"
print_config = true
save_config_file = "none"
custom_config_module = ""
[profiling]
enable_profiling = true
profile_freq = 5
profiler_active = 2
profiler_warmup = 1
[metrics]
log_freq = 1
save_for_all_ranks = false
[model]
name = "llama3"
flavor = "debugmodel_varlen_attn"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
converters = ["quantize.linear.float8"]
[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
implementation = "foreach"
[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0
total_steps = 40
[training]
local_batch_size = 8
global_batch_size = 16
seq_len = 256
max_norm = 1.0
steps = 10
dataset = "c4"
dtype = "float32"
mixed_precision_param = "float32"
mixed_precision_reduce = "float32"
gc_freq = 50
[training.dataloader]
num_workers = 2
pin_memory = true
persistent_workers = true
prefetch_factor = 4
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
pipeline_parallel_schedule = "1F1B"
context_parallel_degree = 1
context_parallel_load_balancer = "headtail"
expert_parallel_degree = 1
expert_tensor_parallel_degree = 1
expert_parallel_comm_backend = "standard"
pipeline_parallel_expert_parallel_overlap = true
[checkpoint]
enable = true
folder = "checkpoint"
interval = 500
last_save_model_only = true
last_save_in_hf = false
export_dtype = "float32"
async_mode = "disabled"
enable_ft_dataloader_checkpoints = true
initial_load_in_hf_quantized = false
load_only = false
[compile]
enable = false
components = ["model", "loss"]
backend = "inductor"
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
per_op_sac_force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]
early_stop = false
memory_budget = 0.5
visualize_memory_budget_pareto = false
preserve_rng_state = true
determinism_check = "default"
debug = false
[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
recipe_name = "tensorwise"
emulate = true
[quantize.linear.mx]
recipe_name = "mxfp8_cublas"
[quantize.grouped_mm.float8]
fqns = []
[comm]
init_timeout_seconds = 300
mode = "default"
save_traces_file_prefix = "rank_"
[memory_estimation]
enable = false
[validation]
enable = true
dataset = "c4_test"
freq = 5
steps = 2
local_batch_size = 4
seq_len = 256
[validation.dataloader]
num_workers = 0
pin_memory = false
[debug]
seed = 7
deterministic = true
deterministic_warn_only = false
moe_force_load_balance = false
"""

V022_NATIVE = """
[job]
dump_folder = "./out022"
print_config = true
[profiling]
enable_profiling = true
profile_freq = 5
active_steps = 2
warmup_steps = 1
[metrics]
log_freq = 1
log_rank = 0
[model]
name = "llama3"
flavor = "debugmodel"
attn_type = "varlen"
attn_mask_type = "block_causal"
tokenizer_path = "./assets/hf/Llama-3.1-8B"
[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8
beta1 = 0.9
beta2 = 0.95
weight_decay = 0.1
implementation = "foreach"
[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0
total_steps = 40
[training]
local_batch_size = 8
global_batch_size = 16
seq_len = 256
max_norm = 1.0
steps = 10
dataset = "c4"
mixed_precision_param = "float32"
mixed_precision_reduce = "float32"
gc_freq = 50
dataloader_num_workers = 2
dataloader_pin_memory = true
dataloader_prefetch_factor = 4
seed = 7
deterministic = true
[checkpoint]
enable = true
folder = "checkpoint"
interval = 500
last_save_model_only = true
last_save_in_hf = false
export_dtype = "float32"
async_mode = "disabled"
[compile]
enable = false
components = ["model", "loss"]
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
early_stop = false
preserve_rng_state = true
[float8]
enable_float8_linear = true
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
recipe = "tensorwise"
emulate = true
filter_fqns = []
[comm]
init_timeout_seconds = 300
[validation]
enable = true
dataset = "pydoc_validation"
freq = 5
steps = 2
local_batch_size = 4
"""

CASES = {"2024": (Y2024, Y2024_NATIVE), "v0.1.0": (V010, V010_NATIVE), "v0.2.2": (V022, V022_NATIVE)}


def merged(tmp_path: Path, name: str, text: str, *cli: str) -> dict:
    path = tmp_path / name
    path.write_text(text)
    tree = to_dict(load_config(["--job.config_file", str(path), *cli]))
    tree["job"].pop("config_file")
    return tree


@pytest.mark.parametrize("dialect", list(CASES))
def test_dialect_file_equals_native_file(tmp_path: Path, dialect: str) -> None:
    old, native = CASES[dialect]
    assert merged(tmp_path, "old.toml", old) == merged(tmp_path, "native.toml", native)


def test_the_files_cover_every_translated_key(tmp_path: Path) -> None:
    """Each translated key (not the refused ones) is spelled in one of the files above or in the
    command-line tests; the flavor, dataset and optional-path rules are value maps on titan keys."""
    import tomllib

    from titan.config.dialects import flatten_toml

    used = set()
    for old, _ in CASES.values():
        used |= {key for key, _ in flatten_toml(tomllib.loads(old))[0]}
    cli_only = {
        "comm.mode",
        "metrics.disable_logging_from_checkpoint",
        "validation.enabled",
        "experimental.custom_model_path",
        "training.enable_fp8_linear",
        "training.enable_fsdp_fp8_all_gather",
        "training.data_parallel_replicate_degree",
        "training.data_parallel_shard_degree",
        "training.disable_loss_parallel",
        "training.fsdp_reshard_after_forward",
        "training.pipeline_parallel_degree",
        "quantize.linear.float8.filter_fqns",
        "experimental.pipeline_parallel_schedule_csv",
        "parallelism.pipeline_parallel_schedule_csv",
    }
    missing = sorted(k for k, r in RULES.items() if not r.refused and k not in used | cli_only)
    assert not missing, missing


@pytest.mark.parametrize(
    "argv, native",
    [
        (["--comm.mode", "fake_backend"], ["--job.dry_run"]),
        (["--validation.enabled"], ["--validation.enable"]),
        (
            ["--training.enable_fp8_linear", "--training.enable_fsdp_fp8_all_gather"],
            ["--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather"],
        ),
        (
            [
                "--training.data_parallel_replicate_degree",
                "2",
                "--training.data_parallel_shard_degree",
                "2",
                "--training.disable_loss_parallel",
                "--training.fsdp_reshard_after_forward",
                "always",
                "--training.pipeline_parallel_degree",
                "2",
            ],
            [
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--parallelism.disable_loss_parallel",
                "--parallelism.fsdp_reshard_after_forward",
                "always",
                "--parallelism.pipeline_parallel_degree",
                "2",
            ],
        ),
        (["--quantize.linear.float8.filter_fqns", "output,wo"], ["--float8.filter_fqns", "output,wo"]),
        (
            ["--experimental.pipeline_parallel_schedule_csv", "s.csv"],
            ["--parallelism.pipeline_parallel_schedule_csv", "s.csv"],
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule_csv",
                "None",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "None",
            ],
            [],
        ),
        (["--metrics.disable_logging_from_checkpoint", "false", "--experimental.custom_model_path", ""], []),
    ],
)
def test_cli_spellings_equal_native(argv: list[str], native: list[str]) -> None:
    assert to_dict(load_config(argv)) == to_dict(load_config(native))


def test_each_translation_logs_once_naming_titans_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[training]\ncompile = true\ndataset = "c4_test"\n[job]\nprint_args = true\n')
    with caplog.at_level(logging.INFO, logger="titan"):
        config = load_config(["--job.config_file", str(path), "--training.compile", "true"])
    # Loading logs nothing (logging is not set up yet): the lines wait on the config ...
    assert not caplog.records
    lines = list(config.translations)
    compile_lines = [line for line in lines if "'training.compile'" in line]
    assert compile_lines == ["torchtitan key 'training.compile' = True -> titan key compile.enable = True"]
    assert sum("'job.print_args'" in line and "job.print_config" in line for line in lines) == 1
    assert "torchtitan key 'training.dataset' = 'c4_test' -> titan key training.dataset = 'pydoc'" in lines
    assert config.training.dataset == "pydoc"
    # ... until the trainer or the dry run has its logger: one INFO record each.
    with caplog.at_level(logging.INFO, logger="titan"):
        log_translations(config.translations)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("INFO", line) for line in lines]
    # A titan config translates nothing.
    assert load_config(["--training.steps", "3"]).translations == ()


@pytest.mark.parametrize(
    "text, line",
    [
        (
            "[training]\ncompile = true\n[compile]\nenable = false\n",
            "'training.compile' = True and 'compile.enable' = False set the same titan key 'compile.enable' to"
            " different values; keep one of them",
        ),
        (
            '[model]\nhf_assets_path = "a"\ntokenizer_path = "b/tokenizer.model"\n',
            "'model.hf_assets_path' = 'a' and 'model.tokenizer_path' = 'b/tokenizer.model' set the same titan key"
            " 'model.tokenizer_path'",
        ),
        (
            '[model]\nconverters = ["float8"]\n[float8]\nenable_float8_linear = false\n',
            "'model.converters' = ['float8'] and 'float8.enable_float8_linear' = False set the same titan key",
        ),
    ],
)
def test_two_spellings_that_disagree_get_one_line(tmp_path: Path, text: str, line: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(TitanError) as e:
        load_config(["--job.config_file", str(path)])
    assert line in str(e.value) and str(e.value).startswith(f"config file '{path}': ")
    assert "\n" not in str(e.value)


def test_agreeing_spellings_load(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[training]\ncompile = true\n[compile]\nenable = true\n[model]\nflavor = "debugmodel_flex_attn"\n'
        'attn_type = "flex"\n'
    )
    c = load_config(["--job.config_file", str(path)])
    assert c.compile.enable and c.model.attn_type == "flex" and c.model.flavor == "debugmodel"


def test_explicit_filter_fqns_beats_torchtitans_implied_default(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[model]\nconverters = ["float8"]\n[float8]\nfilter_fqns = ["output"]\n')
    assert load_config(["--job.config_file", str(path)]).float8.filter_fqns == ["output"]
    # A command-line converter does not undo the file's filter either.
    path.write_text('[float8]\nfilter_fqns = ["wq"]\n')
    assert load_config(["--job.config_file", str(path), "--model.converters", "float8"]).float8.filter_fqns == ["wq"]
    assert load_config(["--model.converters", "float8"]).float8.filter_fqns == []


def test_hf_assets_path_is_the_hf_weights_folder_when_no_initial_load_path() -> None:
    c = load_config(["--model.hf_assets_path", "/hf/llama", "--checkpoint.enable", "--checkpoint.initial_load_in_hf"])
    assert (c.model.tokenizer_path, c.checkpoint.initial_load_path) == ("/hf/llama", "/hf/llama")
    assert load_config(["--model.hf_assets_path", "/hf/llama"]).checkpoint.initial_load_path == ""


def test_validation_seq_len_must_equal_training_seq_len(tmp_path: Path) -> None:
    assert load_config(["--validation.seq_len", "2048"]).training.seq_len == 2048
    with pytest.raises(TitanError) as e:
        load_config(["--validation.seq_len", "512", "--training.seq_len", "256"])
    assert str(e.value) == (
        "torchtitan key 'validation.seq_len' is not supported by titan: titan validates at"
        " training.seq_len; set both to the same length (got '512', training.seq_len is 256)"
    )


def test_unknown_key_in_a_torchtitan_file_names_dialect_and_closest_titan_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[model]\nhf_assets_path = "x"\n[training]\nlocal_batch = 2\n')
    with pytest.raises(TitanError) as e:
        load_config(["--job.config_file", str(path)])
    assert str(e.value) == (
        f"config file '{path}': unknown config key 'training.local_batch' in a config that looks"
        " like torchtitan v0.2.x's (like 'model.hf_assets_path'); closest titan key:"
        " 'training.local_batch_size'"
    )


def test_unknown_key_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    path = tmp_path / "c.toml"
    path.write_text(f'[job]\ndump_folder = "{dump}"\n[quantize.linear.float8]\nemulat = true\n')
    out = subprocess.run(
        [sys.executable, "train.py", "--job.config_file", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"titan: error: config file '{path}': unknown config key 'quantize.linear.float8.emulat' in a config that"
        " looks like torchtitan v0.2.x's (nested tables are torchtitan's spelling; titan's sections are one level"
        " deep); closest titan key: 'float8.emulate'"
    )
    assert not dump.exists()


def test_prefetch_factor_needs_workers() -> None:
    with pytest.raises(TitanError) as e:
        load_config(["--training.dataloader.prefetch_factor", "4"])
    assert str(e.value) == (
        "config key 'training.dataloader_prefetch_factor' got 4; valid: unset, or an integer >= 1"
        " together with training.dataloader_num_workers > 0"
    )


def test_a_titan_config_keeps_titans_unknown_key_line(tmp_path: Path) -> None:
    # model.flavor has a torchtitan value map, but it is titan's key: the file still reads as titan's.
    path = tmp_path / "c.toml"
    path.write_text('[model]\nflavor = "debugmodel"\n[training]\nstepz = 5\n')
    with pytest.raises(TitanError) as e:
        load_config(["--job.config_file", str(path)])
    assert str(e.value) == f"config file '{path}': unknown config key 'training.stepz'; did you mean 'training.steps'?"
