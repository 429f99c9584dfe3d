"""The replica groups' process group knocks on the quorum's store before it reconfigures."""

import socket

import pytest
import torchft

from titan.ft.process_group import ProbedGloo, probe_store, replica_process_group, store_host_port


def test_store_address_forms():
    assert store_host_port("localhost:33339/torchft/11/0") == ("localhost", 33339)
    assert store_host_port("[::1]:29500/torchft/2/1") == ("::1", 29500)
    assert store_host_port("10.0.0.7:1234") == ("10.0.0.7", 1234)


def test_a_live_store_passes_and_a_gone_one_is_refused_at_once():
    with socket.create_server(("localhost", 0)) as live:
        probe_store(f"localhost:{live.getsockname()[1]}/torchft/1/0")
        # A port nobody listens on: the one just freed by a closed server (a killed group's store).
        with socket.create_server(("localhost", 0)) as gone:
            port = gone.getsockname()[1]
    with pytest.raises(RuntimeError, match=f"store localhost:{port} does not answer"):
        probe_store(f"localhost:{port}/torchft/11/0")


def test_the_probed_group_is_torchft_gloo():
    from datetime import timedelta

    pg = replica_process_group("gloo", timedelta(seconds=5))
    assert isinstance(pg, ProbedGloo) and isinstance(pg, torchft.ProcessGroupGloo)
    with pytest.raises(RuntimeError, match="does not answer"):
        with socket.create_server(("localhost", 0)) as gone:
            port = gone.getsockname()[1]
        pg.configure(f"localhost:{port}/torchft/1/0", "titan_replica_0", 0, 2)
