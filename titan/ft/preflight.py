"""What replica groups (torchft) need, checked from the config and the environment alone: before any
process group, TensorBoard writer or metrics file exists, a run that could never join its replica
groups stops with one line.

``check_torchft`` is called by the Trainer first thing and by the launch pre-check (there with a
short wait, and without the lighthouse where the launcher starts one itself after the check).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any, Literal

from titan.errors import TitanError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# How long the first contact with the lighthouse may take before "unreachable": a rank waits for a
# lighthouse that its launcher script started a moment before; the launch pre-check only knocks.
CONNECT_WAIT_S = 15.0
QUICK_WAIT_S = 2.0


def lighthouse_url(env: Mapping[str, str] | None = None) -> tuple[str, str, int]:
    """TORCHFT_LIGHTHOUSE as (url, host, port); one line if it is not set or not an address."""
    env = os.environ if env is None else env
    url = env.get(LIGHTHOUSE_ENV, "")
    if not url:
        raise TitanError(
            f"fault_tolerance.enable needs the lighthouse address in {LIGHTHOUSE_ENV} (e.g. http://host:29510);"
            " start one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510`"
            " (run_train.sh and multinode_trainer.slurm with REPLICA_GROUPS start it for you)"
        )
    try:
        parsed = urllib.parse.urlparse(url)
        host, port = parsed.hostname, parsed.port
    except ValueError:  # a port that is no number or out of range
        host, port = None, None
    if not host or not port:
        raise TitanError(f"{LIGHTHOUSE_ENV}={url!r} is not a lighthouse address; valid: http://host:port")
    return url, host, port


def lighthouse_address(env: Mapping[str, str] | None = None, wait_s: float = CONNECT_WAIT_S) -> str:
    """The lighthouse URL, checked to answer a TCP connect within ``wait_s`` (retried every half
    second: it may be starting); one line naming the address and port if nobody listens there."""
    url, host, port = lighthouse_url(env)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(2.0, max(wait_s, 0.1))).close()
            return url
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TitanError(
                    f"the torchft lighthouse at {url} ({LIGHTHOUSE_ENV}) is unreachable on port {port}"
                    f" ({e.strerror or e}); start it with `torchft_lighthouse --min_replicas 1 --bind [::]:{port}`"
                    " or fix the address"
                ) from None
            time.sleep(0.5)


def check_torchft(
    job_config: Any,
    *,
    env: Mapping[str, str] | None = None,
    lighthouse: Literal["required", "if_set", "skip"] = "required",
    wait_s: float = QUICK_WAIT_S,
) -> None:
    """One TitanError line when fault_tolerance.enable cannot work: torchft not installed, the
    lighthouse address missing, malformed or not answering, or a semi-synchronous method with a
    layout that has more than one model part or optimizer. Nothing without fault_tolerance.enable.

    ``lighthouse``: "required" (a rank: the address must be set and answer), "if_set" (a launcher
    that starts its own lighthouse when TORCHFT_LIGHTHOUSE is unset), "skip" (the dry run, whose
    lighthouse may live only on the cluster)."""
    ft = job_config.fault_tolerance
    if not ft.enable:
        return
    # find_spec, not import: torchft's Rust logger reads RUST_LOG once, when titan/ft/replicas.py
    # has set it (titan/ft/quiet.py).
    if importlib.util.find_spec("torchft") is None:
        raise TitanError("fault_tolerance.enable needs torchft: pip install 'titan[ft]' (or pip install torchft)")
    if ft.semi_sync_method != "none":
        pp = job_config.parallelism.pipeline_parallel_degree
        in_backward = job_config.optimizer.early_step_in_backward
        if pp > 1 or in_backward:
            why = f"parallelism.pipeline_parallel_degree {pp}" if pp > 1 else "optimizer.early_step_in_backward"
            raise TitanError(
                f"config key 'fault_tolerance.semi_sync_method' = {ft.semi_sync_method!r} needs one model part"
                f" with one optimizer in each replica group; {why} gives more (use semi_sync_method"
                ' "none", or no pipeline parallelism and no optimizer in backward)'
            )
    env = os.environ if env is None else env
    if lighthouse == "skip" or (lighthouse == "if_set" and not env.get(LIGHTHOUSE_ENV)):
        return
    lighthouse_address(env, wait_s)
