"""The process group between replica groups: torchft's, refusing a quorum whose store is gone.

The lighthouse counts a killed group as alive until its heartbeat times out, so a quorum formed in
that window can name the dead group's store. torchft's reconfigure then waits on it through the
TCPStore's connect timeout and retries (about 2.5 x fault_tolerance.process_group_timeout_ms: 25 s
at the default) before the step is discarded. A refused or unanswered TCP connect says as much in
milliseconds (a live store's kernel accepts at once, however busy the process), so the step is
discarded at once and the next quorum, formed without the dead group, goes on.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any

import torchft

PROBE_S = 2.0  # a remote host that is gone answers nothing: give up after this
PROBE_TRIES = 3  # a refusal can be a full listen backlog for an instant: knock again first


def store_host_port(store_addr: str) -> tuple[str, int]:
    """'host:port/prefix' (torchft's quorum store address; an IPv6 host in brackets) -> (host, port)."""
    host, _, port = store_addr.split("/", 1)[0].rpartition(":")
    return host.strip("[]"), int(port)


def probe_store(store_addr: str) -> None:
    host, port = store_host_port(store_addr)
    for attempt in range(PROBE_TRIES):
        try:
            socket.create_connection((host, port), timeout=PROBE_S).close()
            return
        except OSError as e:
            if attempt == PROBE_TRIES - 1:
                raise RuntimeError(
                    f"the quorum's store {host}:{port} does not answer ({e.strerror or e}): a replica group in the"
                    " quorum has died since it joined; this step is discarded and the next quorum leaves it out"
                ) from e
            time.sleep(0.05)


class _ProbedConfigure:
    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        probe_store(store_addr)
        super().configure(store_addr, *args, **kwargs)  # pyright: ignore[reportAttributeAccessIssue]


class ProbedGloo(_ProbedConfigure, torchft.ProcessGroupGloo):
    pass


class ProbedNCCL(_ProbedConfigure, torchft.ProcessGroupNCCL):
    pass


def replica_process_group(backend: str, timeout: timedelta) -> Any:
    return ProbedGloo(timeout=timeout) if backend == "gloo" else ProbedNCCL(timeout)
