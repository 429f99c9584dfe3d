"""SageMaker's environment becomes config defaults; TOML and CLI still win."""

from pathlib import Path

from titan.config import load_config
from titan.config.environment import SAGEMAKER_TENSORBOARD, environment_defaults

REPO = Path(__file__).resolve().parents[3]
SM_ENV = {"SM_TRAINING_ENV": "{}", "SM_CURRENT_HOST": "algo-1", "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train"}


def test_sagemaker_env_sets_defaults():
    c = load_config([], env=SM_ENV)
    assert c.training.dataset_path == "/opt/ml/input/data/train"
    assert c.metrics.enable_tensorboard and c.metrics.save_tb_folder == SAGEMAKER_TENSORBOARD
    assert c.checkpoint.folder == "/opt/ml/checkpoints"


def test_toml_and_cli_override_the_environment(tmp_path: Path):
    toml = tmp_path / "c.toml"
    toml.write_text('[metrics]\nsave_tb_folder = "mytb"\n')
    c = load_config(["--job.config_file", str(toml), "--training.dataset_path", "/data"], env=SM_ENV)
    assert c.metrics.save_tb_folder == "mytb" and c.training.dataset_path == "/data"


def test_plain_machine_gets_no_platform_defaults():
    assert environment_defaults({"HOME": "/root"}) == []
    c = load_config([], env={})
    assert c.training.dataset_path == "" and c.metrics.save_tb_folder == "tb"
    # A channel without the rest of SageMaker's env still names the data.
    assert environment_defaults({"SM_CHANNEL_TRAIN": "/d"}) == [("training.dataset_path", "/d")]


def test_train_py_reads_the_process_environment(monkeypatch):
    """train.py calls load_config(argv) without env: the process environment is used."""
    for k, v in SM_ENV.items():
        monkeypatch.setenv(k, v)
    c = load_config(["--config_file", str(REPO / "train_configs/debug_model.toml")])
    assert c.training.dataset_path == "/opt/ml/input/data/train"
    # The shipped configs leave save_tb_folder at its default, so SageMaker picks the folder.
    assert c.metrics.save_tb_folder == SAGEMAKER_TENSORBOARD
