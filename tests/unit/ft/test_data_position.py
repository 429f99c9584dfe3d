"""A replica group's per-step data position: taken over the checkpoint's only when it is newer and
belongs to this run's line (a restart, or a resume of its own checkpoints)."""

from __future__ import annotations

from pathlib import Path

from titan.ft.data_position import DataPosition


class Loader:
    """A data loader's Stateful side: its position is the number of batches drawn."""

    def __init__(self, drawn: int = 0) -> None:
        self.drawn = drawn

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


def saved_at(root: Path, step: int) -> DataPosition:
    pos = DataPosition(str(root), 3, Loader(drawn=step))
    pos.save(step)
    return pos


def test_a_restart_reads_on_from_its_last_step(tmp_path: Path) -> None:
    saved_at(tmp_path, 12)
    assert (tmp_path / "data_position" / "rank3.pt").exists()
    assert not list((tmp_path / "data_position").glob("*.tmp"))
    loader = Loader(drawn=10)  # as the step-10 checkpoint left it
    DataPosition(str(tmp_path), 3, loader).restore(10, resumed=True, load_step=-1, excluded=False)
    assert loader.drawn == 12


def test_the_checkpoint_wins_when_it_is_as_new(tmp_path: Path) -> None:
    saved_at(tmp_path, 10)
    loader = Loader(drawn=-1)
    DataPosition(str(tmp_path), 3, loader).restore(10, resumed=True, load_step=-1, excluded=False)
    assert loader.drawn == -1


def test_a_fresh_start_a_rollback_or_excluded_data_drop_the_file(tmp_path: Path) -> None:
    for kwargs in (
        {"resumed": False, "load_step": -1, "excluded": False},  # a new run in an old folder
        {"resumed": True, "load_step": 5, "excluded": False},  # back to an older checkpoint
        {"resumed": True, "load_step": -1, "excluded": True},  # checkpoint.exclude_from_loading
    ):
        saved_at(tmp_path, 12)
        loader = Loader(drawn=5)
        DataPosition(str(tmp_path), 3, loader).restore(5, **kwargs)
        assert loader.drawn == 5, kwargs
        assert not (tmp_path / "data_position" / "rank3.pt").exists(), kwargs


def test_no_file_changes_nothing(tmp_path: Path) -> None:
    loader = Loader(drawn=7)
    DataPosition(str(tmp_path), 0, loader).restore(7, resumed=True, load_step=-1, excluded=False)
    assert loader.drawn == 7


def test_an_unwritable_folder_warns_once_and_training_goes_on(tmp_path: Path, caplog) -> None:
    (tmp_path / "data_position").write_text("a file where the folder should be")
    pos = DataPosition(str(tmp_path), 0, Loader(drawn=3))
    with caplog.at_level("WARNING", logger="titan"):
        pos.save(3)
        pos.save(4)
    assert sum("not written to" in r.getMessage() for r in caplog.records) == 1
