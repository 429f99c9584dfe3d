"""Epoch boundaries of an endless stream: an INFO line where the run expects to read its data
again, one WARNING where the data ends far earlier than the run needs (more than FAR_PASSES
passes), judged the same after a resume in the middle of a pass."""

from __future__ import annotations

import logging
import re

import pytest

from tests.helpers.doc_loader import make, take
from titan.data.epochs import FAR_PASSES

PASS = len(list(make(infinite=False)))  # batches in one pass over the test source


def _run(caplog, run_passes: float, read_passes: float, loader=None):
    loader = loader or make()
    loader.run_batches = round(run_passes * PASS)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan"):
        take(loader, round(read_passes * PASS))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "epoch" in r.getMessage()]
    return loader, warnings, infos


@pytest.mark.parametrize("run_passes", [1.2, FAR_PASSES - 0.5])
def test_an_expected_boundary_is_one_info_line(caplog, run_passes):
    _, warnings, infos = _run(caplog, run_passes, 1.1)
    assert warnings == []
    assert len(infos) == 1 and infos[0].startswith(
        "dataset 'docs' (dp rank 0, stream 0): read through its data; epoch 1 begins, reading it again in order"
    )
    assert abs(float(re.search(r"about ([0-9.]+) passes", infos[0])[1]) - run_passes) < 0.2, infos


def test_data_that_ends_far_too_early_warns_once(caplog):
    _, warnings, infos = _run(caplog, 4 * FAR_PASSES, 3.1)
    assert len(warnings) == 1, warnings
    assert re.fullmatch(
        r"dataset 'docs' \(dp rank 0, stream 0\): its data ended after about \d+ of the run's \d+ batches: this run"
        rf" reads it about 1[5-7] times over \(more than {FAR_PASSES}\); point training.dataset_path at more data or"
        r" lower training.steps, unless that many passes are intended",
        warnings[0],
    )
    assert [re.search(r"epoch \d+", s)[0] for s in infos] == ["epoch 2", "epoch 3"]


def test_a_resumed_run_judges_the_pass_the_same(caplog):
    first, _, _ = _run(caplog, 4 * FAR_PASSES, 0.6)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    _, warnings, _ = _run(caplog, 4 * FAR_PASSES, 0.6, loader=resumed)
    assert len(warnings) == 1 and re.search(r"about 1[5-7] times over", warnings[0]), warnings


def test_without_the_run_length_every_boundary_is_info(caplog):
    loader = make()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan"):
        take(loader, round(2.1 * PASS))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("begins, reading it again in order" in r.getMessage() for r in caplog.records) == 2


def test_the_default_runs_boundary_is_info(caplog):
    """train_configs/debug_model.toml as shipped: 150 batches, about 1.2 passes over the corpus."""
    from tests.helpers.runs import REPO
    from titan.config import load_config
    from titan.training.build import build_loader
    from titan.training.plan import plan_run

    config = load_config(["--job.config_file", str(REPO / "train_configs/debug_model.toml")])
    plan = plan_run(config, 1, "cpu")
    loader = build_loader(config, plan.tokenizer, plan.parallel_dims)
    assert loader.run_batches == config.training.steps == 150
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan"):
        take(loader, config.training.steps)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    [line] = [r.getMessage() for r in caplog.records if "epoch 1 begins" in r.getMessage()]
    assert re.search(r"\(this run: about 1\.[0-4] passes\)$", line), line
