"""scripts/convert_config.py: a torchtitan file and its conversion load to the same merged config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from titan.config import load_config, to_dict

REPO = Path(__file__).resolve().parents[3]

OLD = """
[job]
description = "converted"
print_args = true
use_for_integration_test = true
[model]
flavor = "debugmodel_flex_attn"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
converters = ["float8"]
[lr_scheduler]
warmup_steps = 2
lr_min = 0.1
[training]
batch_size = 4
seq_len = 128
compile = true
dataset = "c4_test"
[training.dataloader]
num_workers = 1
prefetch_factor = 3
[parallelism]
pipeline_parallel_layers_per_stage = 2
[checkpoint]
enable_checkpoint = true
initial_load_in_hf = true
[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"
[quantize.linear.float8]
emulate = true
recipe_name = "rowwise"
[debug]
seed = 11
[fault_tolerance]
enable = false
"""


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/convert_config.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def _merged(path: Path) -> dict:
    tree = to_dict(load_config(["--job.config_file", str(path)], env={}))
    tree["job"].pop("config_file")
    return tree


def test_converted_file_loads_to_the_same_config(tmp_path: Path) -> None:
    old, new = tmp_path / "old.toml", tmp_path / "new.toml"
    old.write_text(OLD)
    out = _convert(str(old), "-o", str(new))
    assert out.returncode == 0, out.stderr
    text = new.read_text()
    # Only titan's own keys: no torchtitan spelling survives.
    for gone in (
        "print_args",
        "hf_assets_path",
        "converters",
        "lr_min",
        "\nbatch_size =",
        "quantize",
        "[debug]",
        "dataloader]",
    ):
        assert gone not in text
    assert _merged(old) == _merged(new)
    c = load_config(["--job.config_file", str(new)], env={})
    assert (c.model.attn_type, c.checkpoint.initial_load_path, c.float8.filter_fqns) == (
        "flex",
        "./assets/hf/Llama-3.1-8B",
        [],
    )


def test_stdout_and_refusals(tmp_path: Path) -> None:
    old = tmp_path / "old.toml"
    old.write_text(OLD)
    out = _convert(str(old))
    assert out.returncode == 0 and out.stdout.startswith("# titan config converted from")
    bad = tmp_path / "bad.toml"
    bad.write_text('[training]\ndtype = "bfloat16"\n')
    target = tmp_path / "never.toml"
    out = _convert(str(bad), "-o", str(target))
    assert out.returncode == 2 and not target.exists()
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(f"titan: error: config file '{bad}': torchtitan key 'training.dtype' is not supported by titan: ")
    )


def test_an_existing_output_is_not_replaced(tmp_path: Path) -> None:
    old, new = tmp_path / "old.toml", tmp_path / "new.toml"
    old.write_text(OLD)
    new.write_text("keep me")
    out = _convert(str(old), "-o", str(new))
    assert out.returncode == 2 and new.read_text() == "keep me"
    assert out.stderr.strip() == f"titan: error: output file {new} already exists; choose a new name"
