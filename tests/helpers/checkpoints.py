"""A CheckpointManager built from a config and the states a test hands it (no trainer), and a
per-rank state that records what it was given on resume."""

from __future__ import annotations

from typing import Any

from titan.checkpointing.config_diff import snapshot
from titan.checkpointing.manager import CheckpointManager
from titan.checkpointing.rank_states import SavedRankStates


def manager_for(config: Any, states: dict[str, Any], rank_states: dict[str, Any], **facts: Any) -> CheckpointManager:
    """One-process facts unless ``facts`` says otherwise (world_size, rank, dp_rank, dp_degree)."""
    facts = {"world_size": 1, "rank": 0, "dp_rank": 0, "dp_degree": 1} | facts
    model = states.get("model")
    num_params = sum(p.numel() for m in model.parts for p in m.parameters()) if model is not None else 0
    return CheckpointManager(
        config.checkpoint,
        states=states,
        rank_states=rank_states,
        dump_folder=config.job.dump_folder,
        overwrite=config.job.overwrite,
        total_steps=config.training.steps,
        config_record=snapshot(config, facts["dp_degree"]),
        num_params=num_params,
        **facts,
    )


class Counter:
    """A per-rank state that takes every saved rank's states itself (as the data loader does):
    its value becomes the sum of all saved values."""

    def __init__(self, value: int = 0) -> None:
        self.value = value
        self.saved: SavedRankStates | None = None

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        raise AssertionError("load_rank_states is used when an object has it")

    def load_rank_states(self, saved: SavedRankStates) -> None:
        self.saved = saved
        self.value = sum(s["value"] for s in saved.all())


class Position:
    """A per-rank state without load_rank_states: it gets its own rank's state."""

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.position = state_dict["position"]
