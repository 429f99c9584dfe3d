"""Per-rank state files: what a resuming rank sees of them (its own state, every rank's), an
older checkpoint's per-rank DCP keys read the same way, a torn file makes the checkpoint damaged,
and a 2-rank save resumed on 1 rank."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from tests.helpers.checkpoints import Counter, Position, manager_for
from tests.helpers.distributed import run_distributed
from titan.checkpointing.folders import scan
from titan.checkpointing.loading import checkpoint_keys
from titan.checkpointing.rank_states import RankFiles, SavedRankStates, legacy_request, legacy_saved, write_rank_file
from titan.checkpointing.resume import choose_intact
from titan.checkpointing.states import ModelParts, RNGState, TrainState, dcp_call
from titan.config import load_config

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures/legacy_checkpoint/step-4"


def test_saved_rank_states_mine_and_all():
    saved = SavedRankStates([2, 0, 1], lambda i: {"i": i}, my_index=1)
    assert saved.mine() == {"i": 1} and saved.all() == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert SavedRankStates([0], lambda i: {"i": i}, my_index=3).mine() is None  # the saving run had no rank 3
    assert not SavedRankStates([], lambda i: {}, my_index=0)


def test_rank_files_are_read_lazily(tmp_path):
    for r in range(3):
        write_rank_file(str(tmp_path), r, {"pos": {"p": r * 10}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0.pt", "rank_1.pt", "rank_2.pt"]  # no .tmp left
    files = RankFiles(str(tmp_path))
    saved = files.saved("pos", rank=1)
    assert saved.mine() == {"p": 10} and sorted(files._read) == [0, 1]  # rank 0's tells which names exist
    assert saved.all() == [{"p": 0}, {"p": 10}, {"p": 20}]
    assert not files.saved("rng", rank=1)


def test_legacy_per_rank_keys_read_into_saved_rank_states():
    """The fixture (2 ranks, today's layout before per-rank files) keeps them as pickled DCP bytes."""
    keys = checkpoint_keys(str(FIXTURE))
    request = legacy_request(keys, ["rng", "dataloader", "counters"])
    assert request == {"rng": {"rank_0": b"", "rank_1": b""}, "dataloader": {"dp_rank_0": b"", "dp_rank_1": b""}}
    dcp_call(dcp.load, request, checkpoint_id=str(FIXTURE), no_dist=True)
    saved = legacy_saved(request, rank=3, dp_rank=1)
    loaders = saved["dataloader"].all()
    assert [s["dp_rank"] for s in loaders] == [0, 1] and saved["dataloader"].mine() == loaders[1]
    assert saved["rng"].mine() is None and len(saved["rng"].all()) == 2  # global rank 3 did not exist
    rng = RNGState()
    before = torch.get_rng_state()
    rng.load_rank_states(saved["rng"])  # a rank the saving run did not have takes rank 0's
    assert torch.equal(torch.get_rng_state(), saved["rng"].all()[0]["torch"])
    torch.set_rng_state(before)


def _small(folder: Path, *args: str):
    config = load_config(["--checkpoint.enable", "--job.dump_folder", str(folder), "--training.steps", "10", *args])
    torch.manual_seed(0)
    parts = [nn.Linear(4, 4)]
    return config, {"model": ModelParts(parts), "train_state": TrainState()}


def test_a_torn_rank_file_makes_the_checkpoint_damaged(tmp_path):
    config, states = _small(tmp_path)
    rank_states = {"position": Position()}
    manager = manager_for(config, states, rank_states)
    for step in (2, 4):
        rank_states["position"].position = step
        manager.save(step, blocking=True)
    manager.finish(4, preempted=True)
    root = tmp_path / "checkpoint"
    assert [(f.step, f.complete) for f in scan(str(root))] == [(2, True), (4, True)]
    rank_file = root / "step-4/rank_0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-10])
    assert choose_intact(str(root), -1).step == 2  # step-4 skipped as damaged
    rank_file.unlink()
    assert choose_intact(str(root), -1).step == 2
    # and the manager resumes from step 2 by itself
    _, fresh = _small(tmp_path)
    resumed_position = Position()
    resumed = manager_for(config, fresh, {"position": resumed_position})
    resumed.load()
    assert resumed_position.position == 2
    resumed.finish(0, preempted=True)


def _save_on_two(rank: int, world: int, folder: str) -> dict:
    config, states = _small(Path(folder))
    rank_states = {"rng": RNGState(), "counter": Counter(10 + rank), "position": Position(100 + rank)}
    manager = manager_for(config, states, rank_states, world_size=2, rank=rank, dp_rank=rank, dp_degree=2)
    torch.manual_seed(1000 + rank)
    expected = torch.get_rng_state()
    manager.save(3, blocking=True)
    manager.finish(3, preempted=True)
    return {"rng": expected}


def test_two_rank_save_resumed_on_one_rank(tmp_path):
    saved = run_distributed(_save_on_two, 2, str(tmp_path), timeout=300)
    step = tmp_path / "checkpoint/step-3"
    assert {"rank_0.pt", "rank_1.pt"} <= {p.name for p in step.iterdir()}
    config, states = _small(tmp_path)
    counter, position, rng = Counter(), Position(), RNGState()
    manager = manager_for(config, states, {"rng": rng, "counter": counter, "position": position})
    manager.load()
    assert counter.value == 21 and [s["value"] for s in counter.saved.all()] == [10, 11]
    assert position.position == 100  # its own rank's (rank 0)
    assert torch.equal(torch.get_rng_state(), saved[0]["rng"])
    manager.finish(0, preempted=True)
    # a rank the saving run did not have: the fallback load_state_dict(mine()) cannot serve it
    shutil.copytree(tmp_path / "checkpoint", tmp_path / "other/checkpoint")
    config, states = _small(tmp_path / "other")
    manager = manager_for(config, states, {"position": Position()}, world_size=1, rank=0, dp_rank=0)
    (tmp_path / "other/checkpoint/step-3/rank_0.pt").rename(tmp_path / "other/checkpoint/step-3/rank_5.pt")
    with pytest.raises(Exception, match="holds no position state for this rank"):
        manager.load()
