"""A checkpoint written before per-rank files (tests/fixtures/legacy_checkpoint: 2 ranks, per-rank
state as pickled DCP bytes) still resumes, and continues with the losses recorded when it was
made: exactly the uninterrupted run's on 2 ranks, and the resharded loader's on 1 rank. Today's
checkpoint of the same run resumes on 1 rank with those same losses."""

import shutil
from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.runs import TINY_RUN

pytestmark = pytest.mark.slow
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures/legacy_checkpoint/step-4"
# How the fixture was made (its README.md).
ARGS = [
    *TINY_RUN,
    "--model.dim",
    "4",
    "--model.n_layers",
    "1",
    "--model.n_heads",
    "1",
    "--model.n_kv_heads",
    "1",
    "--training.steps",
    "8",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "4",
]
# Trainer.train()'s losses recorded with the code that wrote the fixture.
FIRST = {1: 8.144109725952148, 2: 8.048494338989258, 3: 8.257222175598145, 4: 8.124879837036133}
UNINTERRUPTED = {5: 8.162956237792969, 6: 8.124430656433105, 7: 7.812318801879883, 8: 7.961215019226074}
ONE_RANK = {5: 8.248162269592285, 6: 8.06955623626709, 7: 8.143479347229004, 8: 7.842880725860596}


def _resume(rank: int, world: int, folder: str) -> tuple[int, dict]:
    from titan.config import load_config
    from titan.training.trainer import Trainer

    extra = ["--checkpoint.config_mismatch", "use_new"] if world == 1 else []  # the global batch halves
    trainer = Trainer(load_config([*ARGS, "--job.dump_folder", folder, *extra]))
    return trainer.step, trainer.train()


def _train(rank: int, world: int, folder: str) -> dict:
    from titan.config import load_config
    from titan.training.trainer import Trainer

    return Trainer(load_config([*ARGS, "--job.dump_folder", folder])).train()


def _copy(folder: Path) -> str:
    shutil.copytree(FIXTURE, folder / "checkpoint/step-4")
    return str(folder)


def test_legacy_checkpoint_resumes_on_its_two_ranks(tmp_path):
    for start, losses in run_distributed(_resume, 2, _copy(tmp_path), timeout=600, init_group=False):
        assert start == 4 and losses == UNINTERRUPTED


def test_legacy_checkpoint_resumes_on_one_rank_resharding_the_loader(tmp_path):
    [(start, losses)] = run_distributed(_resume, 1, _copy(tmp_path), timeout=600, init_group=False)
    assert start == 4 and losses == ONE_RANK
    # the new save holds this run's per-rank file, no per-rank DCP keys
    step = tmp_path / "checkpoint/step-8"
    assert (step / "rank_0.pt").is_file() and (step / "COMPLETE").is_file()


def test_todays_checkpoint_of_the_same_run_resumes_on_one_rank_like_the_fixture(tmp_path):
    for losses in run_distributed(_train, 2, str(tmp_path / "run"), timeout=600, init_group=False):
        assert losses == FIRST | UNINTERRUPTED
    shutil.copytree(tmp_path / "run/checkpoint/step-4", tmp_path / "one/checkpoint/step-4")
    assert {"rank_0.pt", "rank_1.pt"} <= {p.name for p in (tmp_path / "one/checkpoint/step-4").iterdir()}
    [(start, losses)] = run_distributed(_resume, 1, str(tmp_path / "one"), timeout=600, init_group=False)
    assert start == 4 and losses == ONE_RANK
