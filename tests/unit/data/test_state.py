"""The typed loader state: plain-Python form, version check, and resuming from per-rank states."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.saved_states import SavedStates
from titan.data.loader import TitanDataLoader
from titan.data.sources import ListSource
from titan.data.state import LoaderState, StreamState, one_state_per_dp_rank
from titan.errors import TitanError


class Tok:
    vocab_size, bos_id, eos_id = 258, 256, 257

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return [self.bos_id] * bos + list(text.encode()) + [self.eos_id] * eos


SOURCE = ListSource("words", [f"document number {i} " * (i % 4 + 1) for i in range(40)])


def make(world: int = 1, rank: int = 0, workers: int = 0) -> TitanDataLoader:
    return TitanDataLoader(
        SOURCE, Tok(), seq_len=9, local_batch_size=2, dp_rank=rank, dp_world_size=world, num_workers=workers
    )


def take(loader, n: int) -> list[list[int]]:
    it = iter(loader)
    return [next(it)[0].flatten().tolist() for _ in range(n)]


def test_state_dict_is_plain_python_that_loads_with_weights_only(tmp_path):
    loader = make(workers=0)
    take(loader, 3)
    state = loader.state_dict()
    torch.save(state, tmp_path / "rank_0.pt")
    loaded = torch.load(tmp_path / "rank_0.pt", weights_only=True)
    assert loaded == state
    assert LoaderState.from_dict(loaded).to_dict() == state
    stream = LoaderState.from_dict(loaded).streams[0]
    assert isinstance(stream, StreamState) and StreamState.from_dict(stream.to_dict()) == stream


@pytest.mark.parametrize("state", [{"version": 1, "streams": []}, {"version": 3}, ["not", "a", "state"]])
def test_unknown_state_version_is_one_line(state):
    with pytest.raises(TitanError, match=r"data loader state has an unknown format \(version .*, expected 2\)") as e:
        make().load_state_dict(state)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


def test_rank_renumbered_by_another_tp_layout_reads_its_own_dp_rank():
    """Saved with dp 2 x tp 2 (global ranks 0, 1 = dp 0; 2, 3 = dp 1), resumed with dp 2 x tp 1:
    global rank 1 is now dp rank 1, while the state global rank 1 saved is dp rank 0's."""
    saved, expected = [], []
    for rank in range(2):
        loader = make(world=2, rank=rank)
        take(loader, 3)
        saved += [loader.state_dict()] * 2
        expected.append(take(loader, 3))
    for rank in range(2):
        loader = make(world=2, rank=rank)
        loader.load_rank_states(SavedStates(saved, rank))
        assert take(loader, 3) == expected[rank]


def test_one_state_per_dp_rank_keeps_the_first_of_each():
    a, b = {"dp_rank": 0, "dp_world_size": 2, "n": 1}, {"dp_rank": 1, "dp_world_size": 2, "n": 2}
    assert one_state_per_dp_rank([a, dict(a, n=9), b, b, "odd"]) == [a, b, "odd"]
