"""What replica groups need, checked from the config and the environment before anything is built:
one line each (torchft missing, the lighthouse unset / not an address / not answering, a
semi-synchronous method over a layout with several model parts), and nothing written."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from titan.config import load_config
from titan.errors import TitanError
from titan.ft import preflight
from titan.ft.preflight import check_torchft

FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


def _closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: a connect is refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_is_checked_without_fault_tolerance() -> None:
    check_torchft(load_config([]), env={})


def test_unreachable_lighthouse_names_its_port_quickly() -> None:
    port = _closed_port()
    env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
    t0 = time.monotonic()
    with pytest.raises(TitanError) as e:
        check_torchft(load_config(FT), env=env, wait_s=0.2)
    assert time.monotonic() - t0 < 5
    line = str(e.value)
    assert "\n" not in line and "{" not in line
    assert f"lighthouse at http://localhost:{port} (TORCHFT_LIGHTHOUSE) is unreachable on port {port}" in line
    assert f"--bind [::]:{port}`" in line


def test_lighthouse_address_missing_or_malformed() -> None:
    with pytest.raises(TitanError, match="needs the lighthouse address in TORCHFT_LIGHTHOUSE"):
        check_torchft(load_config(FT), env={})
    with pytest.raises(TitanError, match="'http://host:port99' is not a lighthouse address; valid"):
        check_torchft(load_config(FT), env={"TORCHFT_LIGHTHOUSE": "http://host:port99"})
    # A launcher that starts its own lighthouse when none is named; the dry run, whose lighthouse
    # may live only on the cluster.
    check_torchft(load_config(FT), env={}, lighthouse="if_set")
    check_torchft(load_config(FT), env={"TORCHFT_LIGHTHOUSE": f"http://localhost:{_closed_port()}"}, lighthouse="skip")
    with pytest.raises(TitanError, match="is unreachable"):
        env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{_closed_port()}"}
        check_torchft(load_config(FT), env=env, lighthouse="if_set", wait_s=0.1)


def test_torchft_missing_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda n, *a: None if n == "torchft" else real(n, *a))
    with pytest.raises(TitanError, match=r"^fault_tolerance.enable needs torchft: pip install 'titan\[ft\]'"):
        check_torchft(load_config(FT), env={}, lighthouse="skip")


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--parallelism.pipeline_parallel_degree", "2"], "parallelism.pipeline_parallel_degree 2 gives more"),
        (["--optimizer.early_step_in_backward"], "optimizer.early_step_in_backward gives more"),
    ],
)
def test_semi_sync_over_several_model_parts(flags: list[str], why: str) -> None:
    config = load_config([*FT, "--fault_tolerance.semi_sync_method", "diloco", *flags])
    with pytest.raises(TitanError, match=why):
        check_torchft(config, env={}, lighthouse="skip")


def test_trainer_checks_before_it_writes_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from titan.training.trainer import Trainer

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://localhost:{_closed_port()}")
    monkeypatch.setattr(preflight, "CONNECT_WAIT_S", 0.2)
    dump = tmp_path / "out"
    config = load_config([*FT, "--job.dump_folder", str(dump), "--metrics.enable_tensorboard"])
    with pytest.raises(TitanError, match="is unreachable on port"):
        Trainer(config)
    assert not dump.exists()
