"""Pipeline stages in the simulator: shapes given, not inferred over the wire."""

from __future__ import annotations

from typing import Any

from titan.tools.simulate.reads import HostReads

__all__ = ["static_stage_shapes"]


def static_stage_shapes(rank: Any, reads: HostReads) -> None:
    if rank.pp_schedule is None:
        return
    raise NotImplementedError("pipeline parallel in the simulator")
