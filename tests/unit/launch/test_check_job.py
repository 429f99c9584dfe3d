"""check_job, the one check before any process group: what it needs a world size for, and what a
rank whose launcher already ran it skips."""

from pathlib import Path

import pytest

import titan.data.build
from titan.config import load_config
from titan.errors import TitanError
from titan.training import checks

REPO = Path(__file__).resolve().parents[3]
BASE = ["--job.config_file", str(REPO / "train_configs/debug_model.toml")]


def test_the_layout_is_checked_only_for_a_known_world_size():
    config = load_config([*BASE, "--parallelism.tensor_parallel_degree", "3"])
    assert checks.check_job(config, None, "cpu") is None  # no world size: the layout waits for one
    with pytest.raises(TitanError, match="do not divide the world size 2"):
        checks.check_job(config, 2, "cpu")
    plan = checks.check_job(load_config(BASE), 2, "cpu")
    assert plan is not None and plan.parallel_dims.world_size == 2


def test_a_rank_checked_by_its_launcher_reads_no_hub_or_checkpoint_again(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(titan.data.build, "check_hub", lambda config: calls.append("hub"))
    monkeypatch.setattr(checks, "check_checkpoint", lambda *a: calls.append("checkpoint") or False)
    config = load_config([*BASE, "--job.dump_folder", str(tmp_path)])
    checks.check_job(config, 1, "cpu", once=False)
    checks.check_job(config, 1, "cpu", data_here=False)  # the dry run, away from the cluster's files
    assert calls == []
    checks.check_job(config, 1, "cpu")
    assert calls == ["hub", "checkpoint"]
    monkeypatch.setenv(checks.CHECKED_ENV, "1")
    assert checks.checked_by_launcher()
    monkeypatch.delenv(checks.CHECKED_ENV)
    assert not checks.checked_by_launcher()
    assert list(tmp_path.iterdir()) == []  # the check writes nothing
