"""The per-rank states of a checkpoint in the shape the checkpoint manager hands them to a
Stateful's ``load_rank_states``: ``mine()`` (what this global rank saved) and ``all()``."""

from __future__ import annotations


class SavedStates:
    def __init__(self, states: list[dict], rank: int) -> None:
        self.states, self.rank = states, rank

    def mine(self) -> dict | None:
        return self.states[self.rank] if self.rank < len(self.states) else None

    def all(self) -> list[dict]:
        return self.states
