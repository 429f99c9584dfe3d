"""Defaults implied by the platform the job runs on, applied below the TOML file and CLI flags.

SageMaker training jobs: the training toolkit exports SM_* variables. Its data channel `train`
is mounted at $SM_CHANNEL_TRAIN, files under /opt/ml/checkpoints are synced to the estimator's
checkpoint_s3_uri, and /opt/ml/output/tensorboard is where TensorBoardOutputConfig in
examples/sagemaker/launch.py picks up event files. A TOML file or flag that sets the same key
still wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SAGEMAKER_CHECKPOINTS = "/opt/ml/checkpoints"
SAGEMAKER_TENSORBOARD = "/opt/ml/output/tensorboard"
# Set in every SageMaker training container by the sagemaker-training toolkit.
_SAGEMAKER_MARKERS = ("SM_TRAINING_ENV", "SM_CURRENT_HOST")


def on_sagemaker(env: Mapping[str, str]) -> bool:
    return any(k in env for k in _SAGEMAKER_MARKERS)


def environment_defaults(env: Mapping[str, str]) -> list[tuple[str, Any]]:
    """(config key, value) pairs, applied below the TOML file and the CLI."""
    pairs: list[tuple[str, Any]] = []
    if env.get("SM_CHANNEL_TRAIN"):
        pairs.append(("training.dataset_path", env["SM_CHANNEL_TRAIN"]))
    if on_sagemaker(env):
        pairs += [
            ("metrics.enable_tensorboard", True),
            ("metrics.save_tb_folder", SAGEMAKER_TENSORBOARD),  # absolute: not under job.dump_folder
            ("checkpoint.folder", SAGEMAKER_CHECKPOINTS),  # synced to checkpoint_s3_uri
        ]
    return pairs
