"""[model] n_layers / dim / n_heads / n_kv_heads override the flavor's shape, checked like every key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from titan.config import load_config
from titan.errors import TitanError
from titan.models import get_model_spec, model_args_from_config
from titan.models.llama import llama3_configs
from titan.training.checks import load_job

REPO = Path(__file__).resolve().parents[3]


def _args(*argv: str):
    cfg = load_config(list(argv))
    return model_args_from_config(get_model_spec(cfg.model.name), cfg.model)


def test_unset_keeps_the_flavor() -> None:
    args = _args("--model.flavor", "8B")
    assert (args.n_layers, args.dim, args.n_heads, args.kv_heads) == (32, 4096, 32, 8)
    assert args is not llama3_configs["8B"]


def test_cli_and_toml_overrides_reach_the_built_model(tmp_path: Path) -> None:
    # The benchmark preset's shape (docs/performance.md): the 8B cut to 8 layers.
    args = _args("--model.flavor", "8B", "--model.n_layers", "8")
    assert (args.n_layers, args.dim, args.n_heads, args.kv_heads, args.ffn_dim_multiplier) == (8, 4096, 32, 8, 1.3)
    assert llama3_configs["8B"].n_layers == 32  # the shared flavor is untouched
    toml = tmp_path / "shape.toml"
    toml.write_text('[model]\nflavor = "debugmodel"\nn_layers = 2\ndim = 128\nn_heads = 4\nn_kv_heads = 2\n')
    from titan.training.trainer import Trainer

    cfg = load_config(
        [
            "--job.config_file",
            str(toml),
            "--job.dump_folder",
            str(tmp_path),
            "--training.steps",
            "1",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "1",
            "--metrics.enable_tensorboard",
            "false",
        ]
    )
    model = Trainer(cfg).model_parts[0]
    assert len(model.layers) == 2
    attn = model.layers["0"].attention
    assert model.tok_embeddings.weight.shape[1] == 128
    assert (attn.n_heads, attn.n_kv_heads, attn.head_dim) == (4, 2, 32)
    assert attn.wk.weight.shape == (2 * 32, 128)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.n_layers", "0"], "config key 'model.n_layers' got 0; valid: an integer >= 1"),
        (["--model.dim", "-8"], "config key 'model.dim' got -8; valid: an integer >= 1"),
        (
            ["--model.n_heads", "30"],
            "model.dim (256) must be divisible by model.n_heads (30) (flavor 'debugmodel' with model.n_heads = 30)",
        ),
        (["--model.n_kv_heads", "3"], "model.n_heads (16) must be divisible by model.n_kv_heads (3)"),
        (["--model.dim", "48", "--model.n_heads", "16"], "must be even for RoPE"),
    ],
)
def test_bad_overrides_fail_at_config_time(argv: list[str], message: str) -> None:
    with pytest.raises(TitanError) as e:
        load_job(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_tensor_parallel_divisibility_sees_the_overrides() -> None:
    from titan.parallel.dims import ParallelDims, check_layout

    args = _args("--model.n_heads", "8", "--model.n_kv_heads", "2")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=4, pp=1, world_size=4)
    with pytest.raises(TitanError, match="tensor_parallel_degree 4 must divide model n_kv_heads"):
        check_layout(dims, load_config([]).parallelism, args, 64, "cuda")


def test_cli_error_is_one_line_with_exit_status_2() -> None:
    out = subprocess.run(
        [sys.executable, "train.py", "--model.n_heads", "0"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "titan: error: config key 'model.n_heads' got 0; valid: an integer >= 1, or unset for the flavor's value"
    )
