"""Resuming on a new layout with checkpoint.exclude_from_loading: the config check covers only the
parts that are loaded (4 gloo ranks save with dp 4, then resume with tp 2 x dp 2)."""

from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.runs import trainer as tiny_trainer
from titan.checkpointing.config_diff import differences, snapshot
from titan.config import load_config
from titan.errors import TitanError

pytestmark = pytest.mark.slow
SAVE = ["--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2"]
NEW_LAYOUT = ["--training.steps", "3", "--checkpoint.enable", "--parallelism.tensor_parallel_degree", "2"]


def test_excluded_parts_are_not_compared():
    base = load_config([])
    changed = load_config(
        [
            "--optimizer.lr",
            "1e-3",
            "--lr_scheduler.warmup_steps",
            "7",
            "--training.seq_len",
            "64",
            "--training.seed",
            "3",
            "--training.max_norm",
            "2",
        ]
    )
    diff = differences(snapshot(base, 4), snapshot(changed, 2))
    assert set(diff) == {
        "optimizer.lr",
        "lr_scheduler.warmup_steps",
        "training.seq_len",
        "training.seed",
        "training.max_norm",
        "effective.global_batch",
    }
    kept = differences(snapshot(base, 4), snapshot(changed, 2), ("lr_scheduler", "dataloader", "optimizer"))
    assert kept == {"training.seed": (None, 3)}
    assert (
        differences(snapshot(base, 4), snapshot(changed, 2), ("dataloader", "optimizer", "lr_scheduler", "rng")) == {}
    )


def _save_then_resume_on_tp(rank: int, world: int, tmp: str) -> tuple[int, dict, str]:
    first = tiny_trainer(Path(tmp), *SAVE)
    first.train()
    saved = {n: p.full_tensor() for n, p in first.model_parts[0].named_parameters()}
    try:  # the data loader's state was written for a global batch of 8: loading it here is refused
        tiny_trainer(Path(tmp), *NEW_LAYOUT)
        refused = ""
    except TitanError as e:
        refused = str(e)
    resumed = tiny_trainer(
        Path(tmp), *NEW_LAYOUT, "--checkpoint.exclude_from_loading", "lr_scheduler,dataloader,optimizer"
    )
    start = resumed.step
    same = all(p.full_tensor().equal(saved[n]) for n, p in resumed.model_parts[0].named_parameters())
    losses = resumed.train()
    return start, {"same_weights": same, "losses": losses}, refused


def test_resume_on_new_layout_with_excluded_parts(tmp_path):
    for start, result, refused in run_distributed(_save_then_resume_on_tp, 4, str(tmp_path), timeout=600):
        assert "effective.global_batch = 8 there, 4 now" in refused
        assert start == 2 and result["same_weights"]
        assert sorted(result["losses"]) == [3]
