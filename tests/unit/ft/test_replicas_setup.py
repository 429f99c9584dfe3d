"""What a replica group checks before it builds anything (the lighthouse address: one line each
way it can be wrong) and how DiLoCo splits the model into fragments."""

from __future__ import annotations

import socket

import pytest

from tests.helpers.tiny import build
from titan.config.sections.fault_tolerance import FaultTolerance
from titan.errors import TitanError
from titan.ft.preflight import lighthouse_address
from titan.ft.semi_sync import fragment_fqns, split_fragments


def test_lighthouse_not_set_not_an_address_or_unreachable_is_one_line() -> None:
    with pytest.raises(TitanError, match="needs the lighthouse address in TORCHFT_LIGHTHOUSE"):
        lighthouse_address({})
    with pytest.raises(TitanError, match="is not a lighthouse address; valid: http://host:port"):
        lighthouse_address({"TORCHFT_LIGHTHOUSE": "lighthouse-host"})
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(TitanError, match=f"lighthouse at http://localhost:{port} .* is unreachable") as e:
            lighthouse_address({"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}, wait_s=0.2)
    assert "\n" not in str(e.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        url = f"http://localhost:{s.getsockname()[1]}"
        assert lighthouse_address({"TORCHFT_LIGHTHOUSE": url}, wait_s=0.2) == url


def test_config_refuses_what_no_step_could_commit() -> None:
    with pytest.raises(TitanError, match="'fault_tolerance.min_replica_size' \\(3\\) is larger than the replica"):
        FaultTolerance(enable=True, group_size=2, min_replica_size=3).validate()
    with pytest.raises(TitanError, match="'fault_tolerance.replica_id' got 2; valid: 0 .. 1"):
        FaultTolerance(enable=True, group_size=2, replica_id=2).validate()
    with pytest.raises(TitanError, match="'fault_tolerance.sync_steps' \\(9\\) must be a multiple of the fragments"):
        FaultTolerance(enable=True, semi_sync_method="diloco", sync_steps=9, num_fragments=2).validate()


def test_fragments_cover_the_model_once_in_order() -> None:
    model = build()
    cfg = FaultTolerance(enable=True, semi_sync_method="diloco", num_fragments=2, sync_steps=4)
    fqns = fragment_fqns(model, cfg)
    flat = [n for f in fqns for n in f]
    n_layers = len(model.get_submodule("layers")._modules)
    assert flat == ["tok_embeddings", *[f"layers.{i}" for i in range(n_layers)], "norm", "output"]
    fragments = split_fragments(model, cfg)
    params = [p for f in fragments for p in f.parameters()]
    assert len(params) == len(list(model.parameters())) and {id(p) for p in params} == {
        id(p) for p in model.parameters()
    }
    bad = FaultTolerance(enable=True, semi_sync_method="diloco", module_fqns_per_model_fragment=[["layers.99"]])
    with pytest.raises(TitanError, match="names 'layers.99', which is not a module of the model"):
        split_fragments(model, bad)


class _TrainState:
    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step}


def _restarted_group(resumed: bool, step: int):  # step: the one in flight
    from titan.ft.replicas import ReplicaGroups

    group = object.__new__(ReplicaGroups)  # the first-quorum logic alone, without torchft's manager
    group.cfg = FaultTolerance(enable=True, group_size=2, replica_id=1)
    group.states = {"train_state": _TrainState(step)}
    group.restart, group.resumed, group._first_quorum, group.url = 1, resumed, True, "http://lh:1"
    return group


@pytest.mark.parametrize(
    "resumed, step, line",
    [
        (True, 21, "it trains on from its own checkpoint at step 21"),
        (False, 1, "it trains on from scratch (no checkpoint of its own) at step 1"),
    ],
)
def test_a_restarted_group_says_where_it_goes_on_from(caplog, resumed: bool, step: int, line: str) -> None:
    group = _restarted_group(resumed, step)
    with caplog.at_level("INFO", logger="titan"):
        # its own previous process, killed while it waited for a quorum, still counted by the
        # lighthouse until its heartbeat times out: not another group under its id
        group.check_quorum(["titan_replica_1:a", "titan_replica_1:dead", "titan_replica_0:b"], heal=False)
        group.check_quorum(["titan_replica_1:a", "titan_replica_0:b"], heal=False)  # first quorum only
    assert [r.getMessage() for r in caplog.records] == [
        f"replica group 1 (restart 1): no live peer is ahead of it; {line}"
    ]
    # Alone in its quorum (every other group finished or is down): it trains on by itself.
    caplog.clear()
    with caplog.at_level("INFO", logger="titan"):
        _restarted_group(resumed, step).check_quorum(["titan_replica_1:a"], heal=False)
    assert [r.getMessage() for r in caplog.records] == [f"replica group 1 (restart 1): no live peer; {line}"]
    # A group that heals says so when the peer's state is loaded, not here.
    caplog.clear()
    with caplog.at_level("INFO", logger="titan"):
        _restarted_group(resumed, step).check_quorum(["titan_replica_1:a", "titan_replica_0:b"], heal=True)
    assert not caplog.records


def test_a_first_attempt_under_a_live_groups_id_stops() -> None:
    group = _restarted_group(False, 0)
    group.restart = 0
    with pytest.raises(TitanError, match="'fault_tolerance.replica_id' = 1 is already used by another live replica"):
        group.check_quorum(["titan_replica_1:a", "titan_replica_1:b"], heal=False)
