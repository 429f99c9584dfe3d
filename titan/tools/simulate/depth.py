"""Shorter depths and the extrapolation to the full one.

A rank that holds more blocks than ``simulate.max_layers`` runs twice on fewer of its own blocks
and every number is extrapolated linearly in the block count. The blocks kept follow the model's
layer pattern, read from the blocks themselves (the module tree, parameter shapes and the plain
attributes of every submodule: DeepSeek-V3's dense blocks before its MoE ones, llama4's and
gpt-oss's alternating blocks, every N-th block checkpointed): each stage of this rank keeps its
first ``prefix + k x period`` blocks, then ``prefix + (k + 1) x period`` with k periods making three
blocks at least, so the two depths differ by one whole period of the pattern and the difference is
what one more period adds. Three blocks at least: the peak of a deep model's step comes in the
backward pass of its last block, while FSDP holds the gathered parameters of the root, of that
block and of the one it prefetches, and the reduce-scatter of the block before; with fewer blocks
some of those are missing (measured on Llama 3 405B: 2 blocks hold 0.37 GiB less communication
than 3, and 3 the same as 4). What grows with the block
count (parameters, gradients, optimizer state, saved activations, per-block collectives and
reads) is then exact; what does not (the transient of a block or two, the embedding and output,
the loss) is the same at every depth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from titan.config.job_config import JobConfig
from titan.parallel.ac import parse_selective_option
from titan.parallel.pp_layout import is_v_schedule, stage_ids_this_rank
from titan.tools.simulate.memory import CATEGORIES, PhasePeak
from titan.tools.simulate.step import StepRecord
from titan.training.plan import RunPlan

__all__ = ["Depths", "choose_depths", "extrapolate"]

_MAX_PERIOD = 8
_MIN_BLOCKS = 3  # the shorter run's blocks at least (a stage's)


@dataclass(frozen=True)
class Depths:
    """The blocks of this rank at full depth, and the two shorter sets run instead (None: run full)."""

    full: tuple[int, ...]
    short: tuple[tuple[int, ...], tuple[int, ...]] | None


def _signature(block: nn.Module) -> tuple:
    """What makes two blocks cost the same: module types, parameter shapes, plain attributes."""
    out = []
    for name, m in block.named_modules():
        attrs = tuple(
            sorted(
                (k, v)
                for k, v in vars(m).items()
                if not k.startswith("_") and "layer_id" not in k and isinstance(v, (bool, int, float, str, type(None)))
            )
        )
        out.append((name, type(m).__name__, tuple(tuple(p.shape) for p in m.parameters(recurse=False)), attrs))
    return tuple(out)


def _period(kinds: Sequence[object]) -> tuple[int, int]:
    """(prefix, period): the shortest period the kinds repeat with (twice at least) after the
    shortest prefix."""
    n = len(kinds)
    for prefix in range(n):
        for period in range(1, min(_MAX_PERIOD, (n - prefix) // 2) + 1):
            if all(kinds[i] == kinds[i + period] for i in range(prefix, n - period)):
                return prefix, period
    return n, 1


def _rank_stages(config: JobConfig, plan: RunPlan, rank: int) -> list[list[int]]:
    """The layer ids of each pipeline stage this rank holds (one list without PP)."""
    stages = plan.model_plan.stages
    dims = plan.parallel_dims
    ids = [0]
    if dims.pp > 1:
        pp_rank = rank // (dims.world_size // dims.pp)
        v_style = is_v_schedule(config.parallelism.pipeline_parallel_schedule)
        ids = stage_ids_this_rank(pp_rank, dims.pp, len(stages), v_style)
    return [[int(n.split(".", 1)[1]) for n in stages[s] if n.startswith("layers.")] for s in ids]


def choose_depths(config: JobConfig, plan: RunPlan, rank: int) -> Depths:
    """This rank's blocks, and the shorter sets to run when it holds more than simulate.max_layers."""
    stages = _rank_stages(config, plan, rank)
    full = tuple(i for stage in stages for i in stage)
    limit = config.simulate.max_layers
    if limit == 0 or len(full) <= limit:
        return Depths(full, None)
    with torch.device("meta"):
        model = plan.spec.model_cls(plan.model_args)
    kinds = {i: _signature(model.layers[str(i)]) for i in full}
    ac = config.activation_checkpoint
    every = parse_selective_option(ac.selective_ac_option) if ac.mode == "selective" else None
    short: list[list[int]] = [[], []]
    n_layers = plan.model_args.n_layers
    for layers in stages:
        # Multi-token prediction's blocks (ids from n_layers on, on the last stage) run in every set.
        stage, mtp = [i for i in layers if i < n_layers], [i for i in layers if i >= n_layers]
        # Every N-th block checkpointed (selective AC by layer id) is part of the pattern too.
        marks = [(kinds[i], i % every == 0 if isinstance(every, int) else None) for i in stage]
        prefix, period = _period(marks)
        periods = -(-_MIN_BLOCKS // period)
        if prefix + (periods + 1) * period >= len(stage):
            return Depths(full, None)  # a stage too short to shorten: run it all
        short[0] += stage[: prefix + periods * period] + mtp
        short[1] += stage[: prefix + (periods + 1) * period] + mtp
    return Depths(full, (tuple(short[0]), tuple(short[1])))


def _line(a: float, b: float, na: int, nb: int, n: int) -> float:
    return max(0.0, a + (b - a) * (n - na) / (nb - na))


def extrapolate(one: StepRecord, two: StepRecord, layers: int) -> StepRecord:
    """The record at ``layers`` blocks from two records at fewer, linearly in the block count."""
    na, nb = one.layers, two.layers

    def line(a: PhasePeak, b: PhasePeak) -> PhasePeak:
        cats = {k: int(_line(a.bytes[k], b.bytes[k], na, nb, layers)) for k in CATEGORIES}
        return PhasePeak(sum(cats.values()), cats)

    # Two moments of each phase, each extrapolated: its peak and its moment of most activations.
    # They are one moment where activations dominate; where they do not, a short run's peak can
    # come where the deep run's does not (the end of backward, with every gradient), while the
    # activations saved per block make the start of backward the deep run's peak.
    peaks, most = {}, {}
    for phase in two.peaks:
        peaks[phase] = line(one.peaks.get(phase, PhasePeak()), two.peaks[phase])
        if phase in one.activation_peaks and phase in two.activation_peaks:
            most[phase] = line(one.activation_peaks[phase], two.activation_peaks[phase])
            peaks[phase] = max(peaks[phase], most[phase], key=lambda p: p.total)
    collectives = {}
    for key in two.collectives.keys() | one.collectives.keys():
        ca, cb = one.collectives.get(key, [0, 0.0]), two.collectives.get(key, [0, 0.0])
        collectives[key] = [round(_line(ca[0], cb[0], na, nb, layers)), _line(ca[1], cb[1], na, nb, layers)]
    reads = {
        k: round(_line(one.host_reads.get(k, 0), two.host_reads.get(k, 0), na, nb, layers))
        for k in one.host_reads.keys() | two.host_reads.keys()
    }
    checkpoint = {
        k: round(_line(one.checkpoint.get(k, 0), two.checkpoint.get(k, 0), na, nb, layers)) for k in two.checkpoint
    }
    # CPU time does not extrapolate (caches warm up over the runs): the runs' own time
    seconds = one.step_seconds + two.step_seconds
    return StepRecord(layers, two.tensors, peaks, collectives, reads, seconds, checkpoint, most)
