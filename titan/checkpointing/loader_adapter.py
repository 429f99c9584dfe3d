"""TEMPORARY, until the data loaders implement ``load_rank_states`` themselves (titan/data): the
data loader as a per-rank Stateful that resumes from another dp layout's states.

It does what the loaders will do: the saved states of one dp rank (every TP/PP/CP rank of it
saved the same) count once; the same dp degree loads this dp rank's state, another one re-deals
the unread documents of all saved dp ranks (``load_resharded``). Delete this file and hand the
trainer's loader to the manager directly once the loaders have the method.
"""

from __future__ import annotations

from typing import Any

from titan.checkpointing.rank_states import SavedRankStates
from titan.log import logger


class ResumableLoader:
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)

    def load_rank_states(self, saved: SavedRankStates) -> None:
        by_dp_rank = {state["dp_rank"]: state for state in saved.all()}
        if len(by_dp_rank) == self.loader.dp_world_size:
            self.loader.load_state_dict(by_dp_rank[self.loader.dp_rank])
            return
        logger.info(f"checkpoint data loader states are from {len(by_dp_rank)} dp ranks, this run has"
                    f" {self.loader.dp_world_size}: resharding")
        self.loader.load_resharded([by_dp_rank[d] for d in sorted(by_dp_rank)])
