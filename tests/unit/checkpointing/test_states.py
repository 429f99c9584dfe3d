"""The manager on its own: it saves and restores the Stateful objects it is handed (no trainer),
under the documented layout (DCP keys by state name, per-rank states in rank_<r>.pt), and leaves
the process's warning filters as it found them."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from tests.helpers.checkpoints import Counter, Position, manager_for
from titan.checkpointing.states import ModelParts, RNGState, TrainState
from titan.config import load_config
from titan.training.lr_scheduler import build_lr_schedulers
from titan.training.optim import build_optimizers

REPO = Path(__file__).resolve().parents[3]
DCP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _manager(folder: Path, seed: int, *args: str):
    config = load_config(
        [
            "--checkpoint.enable",
            "--job.dump_folder",
            str(folder),
            "--training.steps",
            "10",
            "--lr_scheduler.warmup_steps",
            "2",
            *args,
        ]
    )
    torch.manual_seed(seed)
    # Two parts with disjoint FQNs, as pipeline stages have.
    parts = [nn.ModuleDict({"a": nn.Linear(8, 16), "b": nn.Linear(16, 4)}), nn.ModuleDict({"c": nn.Linear(4, 4)})]
    optimizers = build_optimizers(parts, config.optimizer)
    schedulers = build_lr_schedulers(optimizers, config.lr_scheduler, config.training.steps)
    states = dict(model=ModelParts(parts), optimizer=optimizers, lr_scheduler=schedulers, train_state=TrainState())
    rank_states = dict(rng=RNGState(), dataloader=Position(), counters=Counter())
    manager = manager_for(config, states, rank_states)
    return manager, parts, states | rank_states


def _train(parts, states, steps: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        states["optimizer"].zero_grad()
        parts[1]["c"](parts[0]["b"](parts[0]["a"](x))).square().mean().backward()
        states["optimizer"].step()
        states["lr_scheduler"].step()
        states["train_state"].step += 1
        states["train_state"].tokens_seen += 32
        states["dataloader"].position += 4
        states["counters"].value += 1


def test_manager_saves_and_restores_the_states_it_is_handed(tmp_path):
    manager, parts, states = _manager(tmp_path, seed=0)
    manager.load()  # nothing there yet: a fresh start
    _train(parts, states, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.save(3, blocking=True)
        manager.finish(3, preempted=False)
    assert not [w for w in caught if DCP_WARNING in str(w.message)]
    path = tmp_path / "checkpoint" / "step-3"
    assert (path / "COMPLETE").is_file()
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert {"train_state.step", "train_state.tokens_seen"} <= keys
    assert {k.split(".")[0] for k in keys} == {"model", "optimizer", "lr_scheduler", "train_state"}
    assert {k for k in keys if k.startswith("model.")} == {f"model.{k}" for k in states["model"].state_dict()}
    # The per-rank states: one plain file per rank, readable without unpickling code.
    per_rank = torch.load(path / "rank_0.pt", weights_only=True)
    assert sorted(per_rank) == ["counters", "dataloader", "rng"]
    assert per_rank["dataloader"] == {"position": 12} and per_rank["counters"] == {"value": 3}
    assert torch.equal(per_rank["rng"]["torch"], states["rng"].state_dict()["torch"])
    assert "rank_0.pt" in (path / "MANIFEST.json").read_text()

    # A fresh set of objects (other initial weights) resumes from the folder by itself.
    resumed, new_parts, new_states = _manager(tmp_path, seed=1)
    resumed.load()
    assert new_states["train_state"] == TrainState(step=3, tokens_seen=96)
    assert new_states["dataloader"].position == 12
    # load_rank_states gets every saved rank's state; this run's rank 0 saved one
    assert new_states["counters"].value == 3 and new_states["counters"].saved.mine() == {"value": 3}
    for old, new in zip(parts, new_parts):
        for a, b in zip(old.parameters(), new.parameters()):
            assert torch.equal(a, b)
    assert new_states["lr_scheduler"].get_last_lr() == states["lr_scheduler"].get_last_lr()
    # Optimizer moments too: one more identical step gives identical weights.
    _train(parts, states, 1)
    _train(new_parts, new_states, 1)
    for old, new in zip(parts, new_parts):
        for a, b in zip(old.parameters(), new.parameters()):
            assert torch.equal(a, b)
    resumed.finish(4, preempted=True)


def test_exclude_from_loading_leaves_that_state_alone(tmp_path):
    manager, parts, states = _manager(tmp_path, seed=0)
    _train(parts, states, 2)
    manager.save(2, blocking=True)
    manager.finish(2, preempted=True)
    resumed, _, new_states = _manager(tmp_path, 1, "--checkpoint.exclude_from_loading", "dataloader,train_state")
    resumed.load()
    assert new_states["train_state"] == TrainState() and new_states["dataloader"].position == 0
    assert new_states["counters"].value == 2  # not excluded: loaded
    resumed.finish(0, preempted=True)


def test_train_state_round_trip_and_saved_bytes():
    state = TrainState(step=7, tokens_seen=1234)
    # Older checkpoints hold these pickled bytes under the train_state key.
    assert pickle.loads(pickle.dumps(state.state_dict())) == {"step": 7, "tokens_seen": 1234}
    other = TrainState()
    other.load_state_dict(state.state_dict())
    assert other == state


def test_importing_the_manager_installs_no_warning_filter():
    # A fresh interpreter: pytest restores the filters after collecting, which would hide one.
    code = (
        "import warnings, titan.checkpointing.manager as m;"
        f" assert not [f for f in warnings.filters if f[1] is not None and f[1].match({DCP_WARNING!r})]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)
