"""Launch titan as a SageMaker training job (needs `pip install -e ".[sagemaker]"` and AWS credentials).

    python examples/sagemaker/launch.py \
        --image-uri <account>.dkr.ecr.us-west-2.amazonaws.com/titan-sagemaker:latest \
        --role arn:aws:iam::<account>:role/SageMakerRole \
        --config-file train_configs/llama3_8b.toml \
        --train-data s3://my-bucket/tokenized-or-raw-text/ \
        --checkpoint-s3-uri s3://my-bucket/titan/checkpoints/ \
        --tensorboard-s3-uri s3://my-bucket/titan/tensorboard/ \
        --instance-type ml.p5.48xlarge --instance-count 2 \
        --override training.steps=1000

SageMaker starts `torchrun train.py --config_file <config>` on every instance (torch_distributed).
Inside the job titan maps SageMaker's environment to config defaults (titan/config/environment.py):
the `train` channel becomes training.dataset_path, TensorBoard goes to /opt/ml/output/tensorboard
(uploaded to --tensorboard-s3-uri) and checkpoints to /opt/ml/checkpoints (synced with
--checkpoint-s3-uri, so a restarted job resumes). Building the estimator needs no AWS access; only
fit() does, so `--dry-print` shows what would be submitted.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TENSORBOARD_LOCAL = "/opt/ml/output/tensorboard"
CHECKPOINT_LOCAL = "/opt/ml/checkpoints"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image-uri", required=True, help="ECR image built from examples/sagemaker/Dockerfile")
    p.add_argument("--role", required=True, help="IAM role ARN the job runs as")
    p.add_argument("--config-file", default="train_configs/llama3_8b.toml", help="TOML path relative to the repo")
    p.add_argument("--train-data", required=True, help="S3 prefix mounted as the `train` channel")
    p.add_argument(
        "--input-mode",
        default="FastFile",
        choices=("File", "FastFile", "Pipe"),
        help="FastFile streams S3 objects on read; File copies them to the instance first",
    )
    p.add_argument("--checkpoint-s3-uri", default=None, help="S3 prefix synced with /opt/ml/checkpoints")
    p.add_argument("--tensorboard-s3-uri", default=None, help="S3 prefix for TensorBoard event files")
    p.add_argument("--region", default=None, help="AWS region (default: the AWS configuration's)")
    p.add_argument("--instance-type", default="ml.p5.48xlarge")
    p.add_argument("--instance-count", type=int, default=1)
    p.add_argument("--max-run-hours", type=float, default=24.0)
    p.add_argument("--job-name", default="titan", help="base job name (SageMaker appends a timestamp)")
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="titan config override passed as --KEY VALUE, e.g. training.steps=1000 (repeatable)",
    )
    p.add_argument("--dry-print", action="store_true", help="print the estimator's arguments, do not submit")
    return p.parse_args(argv)


def hyperparameters(config_file: str, overrides: list[str]) -> dict[str, str]:
    """SageMaker passes each entry to train.py as `--key value`, which titan's CLI parser reads."""
    hps = {"config_file": config_file}
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--override {item!r}: expected KEY=VALUE, e.g. training.steps=1000")
        hps[key.removeprefix("--")] = value
    return hps


def session(region: str | None):  # -> sagemaker.Session (imported lazily)
    """A SageMaker session; creating it needs a region but no credentials (fit() needs those)."""
    import boto3
    import sagemaker

    return sagemaker.Session(boto_session=boto3.Session(region_name=region))


def stage_source(dest: Path) -> Path:
    """The job's code: train.py, train_configs/ and titan/ (so local edits ship without rebuilding
    the image, which provides the dependencies), and nothing else: no outputs/ or checkpoints."""
    shutil.copy2(REPO / "train.py", dest / "train.py")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("train_configs", "titan"):
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    return dest


def build_estimator(args: argparse.Namespace, source_dir: Path):  # -> sagemaker.pytorch.PyTorch
    from sagemaker.debugger import TensorBoardOutputConfig
    from sagemaker.pytorch import PyTorch

    tensorboard = None
    if args.tensorboard_s3_uri:
        tensorboard = TensorBoardOutputConfig(
            s3_output_path=args.tensorboard_s3_uri, container_local_output_path=TENSORBOARD_LOCAL
        )
    return PyTorch(
        entry_point="train.py",
        source_dir=str(source_dir),
        image_uri=args.image_uri,
        role=args.role,
        instance_type=args.instance_type,
        instance_count=args.instance_count,
        distribution={"torch_distributed": {"enabled": True}},
        hyperparameters=hyperparameters(args.config_file, args.override),
        tensorboard_output_config=tensorboard,
        checkpoint_s3_uri=args.checkpoint_s3_uri,
        checkpoint_local_path=CHECKPOINT_LOCAL if args.checkpoint_s3_uri else None,
        max_run=int(args.max_run_hours * 3600),
        base_job_name=args.job_name,
        input_mode=args.input_mode,
        environment={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        sagemaker_session=session(args.region),
    )


def data_channels(args: argparse.Namespace) -> dict:
    from sagemaker.inputs import TrainingInput

    # FullyReplicated: titan's loader splits documents across data-parallel ranks itself.
    return {"train": TrainingInput(s3_data=args.train_data, distribution="FullyReplicated", input_mode=args.input_mode)}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not (REPO / args.config_file).is_file():
        raise SystemExit(f"--config-file {args.config_file!r} not found under {REPO}")
    with tempfile.TemporaryDirectory(prefix="titan-sagemaker-") as tmp:
        estimator = build_estimator(args, stage_source(Path(tmp)))
        channels = data_channels(args)
        if args.dry_print:
            print(f"image: {estimator.image_uri}\ninstances: {estimator.instance_count} x {estimator.instance_type}")
            configs = {k: v.config for k, v in channels.items()}
            print(f"hyperparameters: {estimator.hyperparameters()}\nchannels: {configs}")
            return 0
        estimator.fit(channels, wait=False)  # uploads the staged source before returning
    print(f"submitted {estimator.latest_training_job.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
