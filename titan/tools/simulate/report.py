"""The simulator's output: a per-rank table for people and, as the last line, one JSON object."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from titan.tools.simulate.memory import CATEGORIES
from titan.tools.simulate.step import StepRecord

__all__ = ["Report", "format_table", "overflow_line", "to_json"]

_GIB = 1024**3


@dataclass
class Report:
    title: str  # model, flavor, layout
    world_size: int
    rank: int
    record: StepRecord  # at the full depth (extrapolated or run)
    estimate: dict[str, int] | None
    estimate_note: str
    layers_run: list[int]  # blocks of each run (one entry: the full depth was run)
    extrapolated: bool
    seconds: float
    device_memory_bytes: int
    notes: list[str] = field(default_factory=list)  # what is fake, assumed, switched off

    @property
    def peak(self) -> tuple[str, dict[str, int]]:
        phase, peak = self.record.peak
        return phase, {**peak.bytes, "total": peak.total}

    def overflow(self) -> str | None:
        """The largest category when the peak is above the device's memory, else None."""
        phase, peak = self.peak
        if peak["total"] <= self.device_memory_bytes:
            return None
        return max(CATEGORIES, key=lambda k: peak[k])


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / _GIB:,.2f}"


def format_table(r: Report) -> str:
    phase, peak = r.peak
    est = r.estimate
    lines = [f"simulate: {r.title}; rank {r.rank} of {r.world_size}", *(f"  {n}" for n in r.notes)]
    lines.append(f"peak memory of rank {r.rank} (in {phase}), GiB:")
    lines.append(f"  {'category':<16} {'simulated':>12} {'estimate':>12}")
    for key in (*CATEGORIES, "total"):
        lines.append(f"  {key:<16} {_gib(peak[key]):>12} {_gib(est[key] if est else None):>12}")
    if est is None:
        lines.append(f"  estimate n/a: {r.estimate_note}")
    phases = ", ".join(f"{p} {_gib(v.total)}" for p, v in r.record.peaks.items())
    lines.append(f"peak of each phase, GiB: {phases}")
    lines.append("collectives of one step (bytes this rank sends, ring algorithms):")
    for (kind, group), (count, sent) in sorted(r.record.collectives.items()):
        lines.append(f"  {kind:<15} {group:<13} {int(count):>7} calls {_gib(sent):>12} GiB")
    reads = r.record.host_reads
    detail = f" ({', '.join(f'{k} {v}' for k, v in sorted(reads.items()))})" if reads else ""
    lines.append(f"device-to-host reads in the step: {sum(reads.values())}{detail}")
    ck = r.record.checkpoint
    if ck:
        lines.append(
            f"checkpoint save plan (DCP, not written): {ck['write_items']} items,"
            f" {_gib(ck['tensor_bytes'])} GiB of tensors (before DCP drops replicated copies across ranks)"
        )
    runs = " and ".join(str(n) for n in r.layers_run)
    depth = f"extrapolated to {r.record.layers} blocks from runs of {runs}" if r.extrapolated else f"{runs} blocks run"
    lines.append(f"{depth}; step {r.record.step_seconds:.1f} s on this CPU; {r.seconds:.1f} s in all")
    return "\n".join(lines)


def overflow_line(r: Report) -> str | None:
    category = r.overflow()
    if category is None:
        return None
    phase, peak = r.peak
    return (
        f"rank {r.rank} of {r.world_size} does not fit simulate.device_memory_gib ="
        f" {r.device_memory_bytes / _GIB:g}: its peak ({phase}) is {_gib(peak['total'])} GiB, of which"
        f" {category} {_gib(peak[category])} GiB is the largest part"
    )


def to_json(r: Report) -> str:
    phase, peak = r.peak
    collectives: dict[str, dict[str, Any]] = {}
    by_group: dict[str, dict[str, Any]] = {}
    for (kind, group), (count, sent) in sorted(r.record.collectives.items()):
        entry = collectives.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += int(count)
        entry["bytes"] += int(sent)
        by_group[f"{kind}@{group}"] = {"count": int(count), "bytes": int(sent)}
    out: dict[str, Any] = {
        "world_size": r.world_size,
        "rank": r.rank,
        "simulated_peak_bytes": {k: int(v) for k, v in peak.items()},
        "estimate_bytes": r.estimate if r.estimate is not None else dict.fromkeys((*CATEGORIES, "total")),
        "collectives": collectives,
        "host_reads": sum(r.record.host_reads.values()),
        "seconds": round(r.seconds, 1),
        "peak_phase": phase,
        "phase_peak_bytes": {p: v.total for p, v in r.record.peaks.items()},
        "collectives_by_group": by_group,
        "checkpoint_plan": r.record.checkpoint,
        "layers": r.record.layers,
        "layers_run": r.layers_run,
        "extrapolated": r.extrapolated,
        "step_seconds": round(r.record.step_seconds, 1),
        "tensors": "fake",
        "fits": r.overflow() is None,
        "device_memory_bytes": r.device_memory_bytes,
    }
    if r.estimate is None:
        out["estimate_note"] = r.estimate_note
    return json.dumps(out, sort_keys=False)
