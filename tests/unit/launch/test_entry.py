"""What a rank runs (train.py, python -m titan.train): a user error anywhere, from the command line to
the Trainer, is one line and exit status 2; a rank after the process group started names itself and
the group is destroyed after the report; debugging keeps tracebacks; a bug keeps its traceback;
print_config prints on rank 0; a rank started by a launcher watches it; SageMaker's --config_file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import titan.training.trainer
import train
from tests.helpers.distributed import one_rank_group
from titan.errors import TitanError

REPO = Path(__file__).resolve().parents[3]
DEBUG_MODEL = str(REPO / "train_configs/debug_model.toml")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


class _Recorder:
    """Stands in for the Trainer: records the configs it was built with."""

    built: list = []

    def __init__(self, config):
        self.built.append(config)

    def train(self):
        return {}


@pytest.fixture
def trainer_stub(monkeypatch):
    monkeypatch.setattr(_Recorder, "built", [])
    monkeypatch.setattr(titan.training.trainer, "Trainer", _Recorder)
    return _Recorder


def test_a_bad_flag_fails_before_torch_is_imported():
    code = "import sys, train; rc = train.main(['--training.stepz', '3']); print(rc, 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert out.stderr.strip() == "titan: error: unknown config key 'training.stepz'; did you mean 'training.steps'?"


def test_a_user_error_inside_the_trainer_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    # the flavor is checked against the model registry by the Trainer, not by the entry
    monkeypatch.delenv("RANK", raising=False)
    argv = ["--job.config_file", DEBUG_MODEL, "--model.flavor", "nosuch", "--job.dump_folder", str(tmp_path)]
    assert train.main(argv) == 2
    assert _one_line(capsys).startswith("titan: error: config key 'model.flavor' got 'nosuch'; valid for llama3:")
    assert not dist.is_initialized()


def _failing_trainer(error: TitanError, store: Path):
    class Failing:
        def __init__(self, config):
            one_rank_group(str(store))
            raise error

    return Failing


@pytest.mark.parametrize("same_on_all_ranks", [False, True], ids=["rank-specific", "same-on-all-ranks"])
def test_an_error_after_the_group_started_names_the_rank_then_the_group_ends(
    same_on_all_ranks, capsys, monkeypatch, tmp_path
):
    error = TitanError("checkpoint step 2: writing /x failed (No space left on device)")
    if same_on_all_ranks:
        error.same_on_all_ranks = True  # type: ignore[attr-defined]
    monkeypatch.setattr(titan.training.trainer, "Trainer", _failing_trainer(error, tmp_path / "store"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    try:
        assert train.main(["--job.config_file", DEBUG_MODEL, "--job.dump_folder", str(tmp_path)]) == 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            pytest.fail("the entry left its process group behind")
    err = capsys.readouterr().err.strip()
    written = json.loads((tmp_path / "error.json").read_text())["message"]
    if same_on_all_ranks:  # rank 0 prints it; every rank tells torchrun
        assert err == "" and written == f"titan: error: {error}"
    else:
        assert err == written == f"titan: error on rank 1: {error}"


def test_before_the_group_only_rank_0_prints(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert train.main(["--training.stepz", "3"]) == 2
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "error.json").read_text())["message"].startswith(
        "titan: error: unknown config key 'training.stepz'"
    )


def test_debugging_keeps_the_traceback(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TITAN_DEBUG", "1")
    with pytest.raises(TitanError, match="unknown config key 'training.stepz'"):
        train.main(["--training.stepz", "3"])
    monkeypatch.delenv("TITAN_DEBUG")
    # job.debug from the TOML file counts once the config is loaded
    toml = tmp_path / "debug.toml"
    toml.write_text(Path(DEBUG_MODEL).read_text().replace("[job]", "[job]\ndebug = true", 1))
    with pytest.raises(TitanError, match="model.flavor"):
        train.main(["--job.config_file", str(toml), "--model.flavor", "nosuch", "--job.dump_folder", str(tmp_path)])
    # --help is not a run: an unknown topic stays one line
    assert train.main(["--help", "chekpoint", "--job.debug"]) == 2
    assert _one_line(capsys).startswith("titan: error: --help: unknown config section 'chekpoint'")


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    class Buggy:
        def __init__(self, config):
            raise RuntimeError("Connection closed by peer")  # a peer-lost phrase, but no process group

    monkeypatch.setattr(titan.training.trainer, "Trainer", Buggy)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        train.main(["--job.config_file", DEBUG_MODEL, "--job.dump_folder", str(tmp_path)])


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_print_config_on_rank_0(rank, printed, trainer_stub, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", rank)
    assert (
        train.main(
            [
                "--job.config_file",
                DEBUG_MODEL,
                "--job.print_config",
                "--training.steps",
                "7",
                "--job.dump_folder",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert ("[training]" in out and "steps = 7" in out) == printed, out
    assert [c.training.steps for c in trainer_stub.built] == [7]


@pytest.mark.parametrize("launched", [True, False], ids=["under-torchrun", "plain"])
def test_a_rank_started_by_a_launcher_watches_it(launched, trainer_stub, monkeypatch, tmp_path):
    import titan.launch.parent

    watched = []
    monkeypatch.setattr(titan.launch.parent, "watch_parent", lambda: watched.append(True))
    if launched:
        monkeypatch.setenv("LOCAL_RANK", "0")
    else:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert train.main(["--job.config_file", DEBUG_MODEL, "--job.dump_folder", str(tmp_path)]) == 0
    assert watched == ([True] if launched else [])


def test_sagemakers_config_file_hyperparameter(trainer_stub, capsys, tmp_path):
    # SageMaker starts `torchrun train.py --config_file <file>`
    assert train.main(["--config_file", DEBUG_MODEL, "--job.dump_folder", str(tmp_path)]) == 0
    assert trainer_stub.built[0].model.flavor == "debugmodel"
    assert train.main(["--config_file", str(tmp_path / "nope.toml")]) == 2
    assert _one_line(capsys).startswith(f"titan: error: config file '{tmp_path / 'nope.toml'}' does not exist")
