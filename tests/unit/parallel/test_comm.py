"""[comm]: flight-recorder environment and the switch to the training timeout."""

import os

import pytest

from titan.config import load_config
from titan.errors import TitanError
from titan.parallel.comm import set_comm_env


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    ):
        monkeypatch.delenv(name, raising=False)


def test_flight_recorder_env(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    c = load_config(["--job.dump_folder", str(tmp_path), "--comm.trace_buf_size", "500"])
    set_comm_env(c.comm, c.job.dump_folder, nccl=True)
    # the name torch reads now; the deprecated one (a warning from every process group) is not set
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "comm_traces" / "rank_")
    assert (tmp_path / "comm_traces").is_dir()


def test_no_trace_folder_where_nothing_dumps(tmp_path, clean_env, monkeypatch):
    """gloo has no flight recorder: a CPU run (or one refused in its ranks) leaves no empty folder."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    c = load_config(["--job.dump_folder", str(tmp_path / "run"), "--comm.trace_buf_size", "500"])
    set_comm_env(c.comm, c.job.dump_folder, nccl=False)
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "run" / "comm_traces" / "rank_")
    assert not (tmp_path / "run").exists()


def test_flight_recorder_off(tmp_path, clean_env):
    c = load_config(["--job.dump_folder", str(tmp_path), "--comm.trace_buf_size", "0"])
    set_comm_env(c.comm, c.job.dump_folder)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ
    assert not (tmp_path / "comm_traces").exists()


def test_bad_timeout_fails_at_load():
    with pytest.raises(TitanError, match="comm.train_timeout_seconds"):
        load_config(["--comm.train_timeout_seconds", "0"])


@pytest.mark.parametrize(
    "preset, nccl, warned",
    [
        (None, True, False),  # nothing set before: nothing replaced
        ("1", True, False),  # torchrun's default for every worker, not the user's choice
        ("0", True, True),  # the user's own value, and NCCL reads it
        ("0", False, False),  # gloo never reads it
    ],
)
def test_env_warning_only_for_user_values_nccl_reads(tmp_path, clean_env, monkeypatch, caplog, preset, nccl, warned):
    if preset is not None:
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", preset)
    c = load_config(["--job.dump_folder", str(tmp_path)])
    with caplog.at_level("WARNING", logger="titan"):
        set_comm_env(c.comm, c.job.dump_folder, nccl=nccl)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    messages = [r.getMessage() for r in caplog.records if "TORCH_NCCL" in r.getMessage()]
    assert bool(messages) == warned, messages
    if warned:
        assert messages == [
            "[comm] TORCH_NCCL_ASYNC_ERROR_HANDLING=0 from the environment is replaced by 3 ([comm] config)"
        ]
