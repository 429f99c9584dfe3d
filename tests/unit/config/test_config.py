import subprocess
import sys
from pathlib import Path

import pytest

from titan.config import JobConfig, format_help, load_config
from titan.config.manager import field_docs, section_fields, sections
from titan.errors import TitanError

REPO = Path(__file__).resolve().parents[3]


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file():
    c = load_config([])
    assert c == JobConfig()


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n")
    c = load_config(["--job.config_file", path, "--training.steps", "3"])
    assert c.training.steps == 3  # CLI wins
    assert c.training.seq_len == 64  # TOML wins over the default
    assert c.optimizer.lr == 0.01
    assert c.training.local_batch_size == JobConfig().training.local_batch_size  # default
    assert c.job.config_file == path


def test_cli_order_independent_of_config_file_position(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 7\n")
    c = load_config(["--training.steps", "3", "--job.config_file", path])
    assert c.training.steps == 3


def test_sagemaker_style_config_file(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 9\n")
    assert load_config(["--config_file", path]).training.steps == 9
    assert load_config([f"--config_file={path}"]).training.steps == 9


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--metrics.enable_tensorboard"], True),
        (["--metrics.enable_tensorboard", "false"], False),
        (["--metrics.enable_tensorboard", "True"], True),
        (["--metrics.enable_tensorboard=0"], False),
        (["--metrics.enable_tensorboard", "--training.steps", "2"], True),
    ],
)
def test_bool_flags(argv, expected):
    assert load_config(argv).metrics.enable_tensorboard is expected


def test_optional_and_float_values():
    c = load_config(["--lr_scheduler.decay_ratio", "0.5", "--training.seed", "3"])
    assert c.lr_scheduler.decay_ratio == 0.5 and c.training.seed == 3
    c = load_config(["--lr_scheduler.decay_ratio", "none", "--optimizer.lr=1e-3"])
    assert c.lr_scheduler.decay_ratio is None and c.optimizer.lr == 1e-3


def test_toml_int_accepted_for_float(tmp_path):
    path = _toml(tmp_path, "[optimizer]\nlr = 1\n")
    assert load_config(["--job.config_file", path]).optimizer.lr == 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stepz", "5"], "unknown config key 'training.stepz'; did you mean 'training.steps'?"),
        (["--trainin.steps", "5"], "unknown config section 'trainin'; did you mean 'training'?"),
        (["--training", "5"], "names a section"),
        (["--training.steps", "abc"], "config key 'training.steps' got 'abc', expected int"),
        (["--training.steps", "1.5"], "expected int"),
        (["--optimizer.lr", "fast"], "config key 'optimizer.lr' got 'fast', expected float"),
        (["--training.seed", "x"], "expected int | None"),
        (["--training.steps"], "'--training.steps' needs a value"),
        (["steps"], "unexpected command-line argument 'steps'"),
        (["--training.steps", "0"], "config key 'training.steps' got 0; valid: an integer >= 1"),
        (
            ["--lr_scheduler.decay_type", "exp"],
            "config key 'lr_scheduler.decay_type' got 'exp'; valid: linear, sqrt, cosine",
        ),
        (["--training.mixed_precision_param", "fp8"], "valid: float32, bfloat16"),
        (
            ["--checkpoint.export_dtype", "float64"],
            "config key 'checkpoint.export_dtype' got 'float64'; valid: float32, bfloat16, float16",
        ),
        (
            ["--compile.components", "model,optimizer"],
            "config key 'compile.components' got 'optimizer'; valid: model, loss",
        ),
        (["--activation_checkpoint.mode", "partial"], "got 'partial'; valid: none, full, selective"),
        (
            ["--optimizer.implementation", "apex"],
            "'optimizer.implementation' got 'apex'; valid: auto, for-loop, foreach, fused",
        ),
        (["--model.n_layers", "0"], "config key 'model.n_layers' got 0; valid: an integer >= 1, or unset"),
        (["--parallelism.data_parallel_shard_degree", "0"], "-1 (the rest) or an integer >= 1"),
        (["--job.config_file", "/nonexistent/x.toml"], "config file '/nonexistent/x.toml' does not exist"),
    ],
)
def test_bad_cli(argv, message):
    with pytest.raises(TitanError) as e:
        load_config(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[training]\nstepz = 5\n", "unknown config key 'training.stepz'; did you mean 'training.steps'?"),
        ("[trainig]\nsteps = 5\n", "unknown config section 'trainig'; did you mean 'training'?"),
        ('[training]\nsteps = "ten"\n', "config key 'training.steps' got 'ten', expected int"),
        ("[training]\nsteps = true\n", "got True, expected int"),
        ('[metrics]\nenable_tensorboard = "yes"\n', "expected bool"),
        ("[model]\nflavor = 8\n", "expected str"),
        ('[model]\nattn_type = "flash"\n', "config key 'model.attn_type' got 'flash'; valid: sdpa, flex, varlen"),
        ("[model]\nattn_type = 1\n", "config key 'model.attn_type' got 1; valid: sdpa, flex, varlen"),
        ('[float8]\nrecipe = ["rowwise"]\n', "config key 'float8.recipe' got ['rowwise']; valid: tensorwise, rowwise"),
        ('[checkpoint]\nexclude_from_loading = "model"\n', "got 'model', expected list['model' | 'optimizer'"),
        ("steps = 5\n", "unknown config section 'steps'"),
        ("[training\nsteps = 5\n", "is not valid TOML"),
        ("[training.sub]\nx = 1\n", "sections are one level deep"),
    ],
)
def test_bad_toml(tmp_path, text, message):
    path = _toml(tmp_path, text)
    with pytest.raises(TitanError) as e:
        load_config(["--job.config_file", path])
    assert message in str(e.value)
    assert path in str(e.value) or "unknown config" in str(e.value)


def test_every_field_documented():
    for name, cls in sections().items():
        docs = field_docs(cls)
        for field in section_fields(cls):
            assert docs.get(field), f"{name}.{field} has no docstring"


def test_help_lists_every_option():
    text = format_help()
    for name, cls in sections().items():
        for field in section_fields(cls):
            assert f"--{name}.{field} " in text


def test_help_and_reference_show_the_choices():
    assert (
        "--activation_checkpoint.mode ('none' | 'full' | 'selective' | 'memory_budget', default: 'none')"
        in format_help()
    )
    assert "--compile.components (list['model' | 'loss'], default: ['model', 'loss'])" in format_help("compile")
    reference = (REPO / "docs" / "config_reference.md").read_text()
    assert "| `model.attn_type` | `'sdpa' \\| 'flex' \\| 'varlen'` | `'sdpa'` |" in reference


def test_literal_choices_load_from_cli_and_toml(tmp_path):
    path = _toml(tmp_path, '[checkpoint]\nexclude_from_loading = ["dataloader"]\n[float8]\nrecipe = "rowwise"\n')
    c = load_config(
        [
            "--job.config_file",
            path,
            "--model.attn_type",
            "flex",
            "--checkpoint.exclude_from_loading",
            "optimizer,dataloader",
        ]
    )
    assert (c.model.attn_type, c.float8.recipe) == ("flex", "rowwise")
    assert c.checkpoint.exclude_from_loading == ["optimizer", "dataloader"]


def test_config_package_imports_nothing_above_it():
    """titan.config is the ground floor: loading a config imports neither torch nor the rest of titan."""
    code = (
        "import sys; from titan.config import load_config; load_config([]);"
        " above = sorted(m for m in sys.modules if m == 'torch' or (m.startswith('titan.')"
        " and not m.startswith('titan.config') and m != 'titan.errors')); print(above)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_train_py_help_and_bad_flag_exit_codes():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "--training.steps" in out.stdout
    out = subprocess.run(
        [sys.executable, "train.py", "--training.stepz", "1"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert out.stderr.strip() == "titan: error: unknown config key 'training.stepz'; did you mean 'training.steps'?"
