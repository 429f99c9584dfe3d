"""examples/sagemaker/launch.py builds the estimator the seed documents, offline (only fit() needs AWS)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

sagemaker = pytest.importorskip(
    "sagemaker.pytorch", reason="SageMaker SDK not installed (pip install -e '.[sagemaker]')"
)


@pytest.fixture(scope="module")
def launch():
    os.environ.setdefault("SAGEMAKER_SUPPRESS_V2_WARNING", "1")
    spec = importlib.util.spec_from_file_location("sm_launch", REPO / "examples/sagemaker/launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_estimator_arguments(launch, tmp_path):
    args = launch.parse_args(
        [
            "--region",
            "us-west-2",
            "--image-uri",
            "123456789012.dkr.ecr.us-west-2.amazonaws.com/titan:1",
            "--role",
            "arn:aws:iam::123456789012:role/SageMaker",
            "--config-file",
            "train_configs/llama3_70b.toml",
            "--train-data",
            "s3://bucket/c4/",
            "--checkpoint-s3-uri",
            "s3://bucket/ckpt/",
            "--tensorboard-s3-uri",
            "s3://bucket/tb/",
            "--instance-type",
            "ml.p5.48xlarge",
            "--instance-count",
            "4",
            "--override",
            "training.steps=50",
            "--override=--metrics.log_freq=5",
        ]
    )
    est = launch.build_estimator(args, launch.stage_source(tmp_path))
    assert isinstance(est, sagemaker.PyTorch)
    assert est.entry_point == "train.py" and est.source_dir == str(tmp_path)
    assert est.image_uri.endswith("/titan:1") and est.role.endswith("role/SageMaker")
    assert (est.instance_type, est.instance_count) == ("ml.p5.48xlarge", 4)
    assert est.distribution == {"torch_distributed": {"enabled": True}}
    hps = {k: json.loads(v) for k, v in est.hyperparameters().items()}
    assert hps["config_file"] == "train_configs/llama3_70b.toml"
    assert hps["training.steps"] == "50" and hps["metrics.log_freq"] == "5"
    tb = est.tensorboard_output_config._to_request_dict()
    assert tb == {"S3OutputPath": "s3://bucket/tb/", "LocalPath": "/opt/ml/output/tensorboard"}
    assert (est.checkpoint_s3_uri, est.checkpoint_local_path) == ("s3://bucket/ckpt/", "/opt/ml/checkpoints")
    channel = launch.data_channels(args)["train"].config
    assert channel["DataSource"]["S3DataSource"]["S3Uri"] == "s3://bucket/c4/"
    assert channel["DataSource"]["S3DataSource"]["S3DataDistributionType"] == "FullyReplicated"
    # The staged source holds what the job runs, and not the repo's outputs or tests.
    assert (tmp_path / "train.py").is_file() and (tmp_path / "train_configs/llama3_70b.toml").is_file()
    assert (tmp_path / "titan/training/trainer.py").is_file() and not (tmp_path / "tests").exists()


def test_hyperparameters_pass_through_titans_parser(launch):
    from titan.config.manager import parse_cli

    hps = launch.hyperparameters("train_configs/debug_model.toml", ["training.steps=7"])
    argv = [tok for k, v in hps.items() for tok in (f"--{k}", v)]  # how the toolkit calls train.py
    assert parse_cli(argv) == [("job.config_file", "train_configs/debug_model.toml"), ("training.steps", "7")]
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        launch.hyperparameters("x.toml", ["training.steps"])
