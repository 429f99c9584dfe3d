"""The run plan: the Trainer and the dry run plan a config alike, and a checkpoint's config merged
in (checkpoint.config_mismatch = use_checkpoint) is checked and planned again."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.runs import TINY_CKPT, TINY_RUN
from titan.config import load_config
from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.tools.dry_run import run_dry_run
from titan.training import checks as checks_module
from titan.training import trainer as trainer_module
from titan.training.checks import check_job
from titan.training.plan import RunPlan, plan_run
from titan.training.trainer import Trainer


def _facts(plan: RunPlan) -> dict[str, Any]:
    """What a plan decides, comparable across processes (the layout without its mesh)."""
    d = plan.parallel_dims
    return {
        "layout": (d.dp_replicate, d.dp_shard, d.cp, d.tp, d.pp, d.world_size, d.loss_parallel_enabled),
        "model": plan.spec.name,
        "model_args": dataclasses.asdict(plan.model_args),
        "grad_accum_steps": plan.grad_accum_steps,
        "model_plan": plan.model_plan,
    }


def _args(folder: Path, world: int, *extra: str) -> list[str]:
    return [
        *TINY_RUN,
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(folder),
        "--job.dry_run_world_size",
        str(world),
        *extra,
    ]


def _trainer_facts(rank: int, world: int, args: list[str]) -> dict[str, Any]:
    return _facts(Trainer(load_config(args)).plan)


def test_trainer_and_dry_run_plan_alike(tmp_path):
    """One process, two micro-batches per step: the same layout, model args, accumulation and split."""
    args = _args(tmp_path, 1, "--training.global_batch_size", "4")
    trained = _facts(Trainer(load_config(args)).plan)
    report = run_dry_run(load_config(args))
    assert _facts(report.plan) == trained
    assert trained["grad_accum_steps"] == 2 and trained["model_args"]["max_seq_len"] == 32
    assert len(trained["model_plan"].stages) == 1 and trained["model_plan"].stages[0][0] == "tok_embeddings"


@pytest.mark.slow
def test_trainer_and_dry_run_plan_a_pipeline_alike(tmp_path):
    """Two pipeline stages on two gloo ranks against the dry run's fake world of two."""
    args = _args(
        tmp_path,
        2,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--training.local_batch_size",
        "4",
    )
    ranks = run_distributed(_trainer_facts, 2, args)
    report = run_dry_run(load_config(args))
    assert ranks[0] == ranks[1] == _facts(report.plan)
    stages = report.plan.model_plan.stages
    assert len(stages) == 2 and stages[0][0] == "tok_embeddings" and stages[1][-1] == "output"


def test_plan_checks_the_layout_for_the_device():
    """Checks that need the device: CP trains only on CUDA, so a CPU run is refused in one line."""
    config = load_config([*TINY_RUN, "--parallelism.context_parallel_degree", "2"])
    assert plan_run(config, 2, "cuda", data_here=False).parallel_dims.cp == 2
    with pytest.raises(TitanError, match=r"context_parallel_degree > 1 trains only on CUDA"):
        plan_run(config, 2, "cpu")


def test_merged_checkpoint_config_is_checked_and_planned_again(tmp_path, monkeypatch):
    """use_checkpoint takes the checkpoint's optimizer.lr: the merged config is validated and planned."""
    folder = tmp_path / "run"
    Trainer(load_config([*TINY_CKPT, "--training.steps", "2", "--job.dump_folder", str(folder)])).train()
    planned: list[float] = []
    validated: list[float] = []
    original_validate = getattr(JobConfig, "validate", None)

    def plan_spy(config: JobConfig, *args: Any, **kwargs: Any) -> RunPlan | None:
        planned.append(config.optimizer.lr)
        return check_job(config, *args, **kwargs)

    def validate_spy(self: JobConfig) -> None:
        validated.append(self.optimizer.lr)
        if original_validate is not None:
            original_validate(self)

    monkeypatch.setattr(trainer_module, "check_job", plan_spy)  # the trainer's first plan
    monkeypatch.setattr(checks_module, "check_job", plan_spy)  # replan's, with the merged config
    monkeypatch.setattr(JobConfig, "validate", validate_spy, raising=False)
    config = load_config(
        [
            *TINY_CKPT,
            "--training.steps",
            "3",
            "--job.dump_folder",
            str(folder),
            "--optimizer.lr",
            "0.5",
            "--checkpoint.config_mismatch",
            "use_checkpoint",
        ]
    )
    saved_lr = load_config(TINY_CKPT).optimizer.lr
    validated.clear()  # load_config may validate too: count the trainer's own call
    trainer = Trainer(config)
    assert planned == [0.5, saved_lr] and validated == [saved_lr]
    assert trainer.config.optimizer.lr == saved_lr
    trainer.checkpointer.finish(trainer.step, preempted=True)
