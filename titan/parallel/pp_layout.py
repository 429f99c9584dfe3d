"""Pipeline parallelism's layout: which modules each stage holds, which stages a rank runs, and the
schedules by name, decided from the config alone (the pre-check, the dry run, the memory estimate
and the simulator use it; titan.parallel.pp builds the stages and schedules with torch's runtime).
"""

from __future__ import annotations

import math
import os

from titan.config.job_config import Parallelism
from titan.errors import TitanError

# torch.distributed.pipelining's schedules (the names its get_schedule_class takes, in any case)
# and the stages each runs per rank: "single" (one), "multi" (looped: several), "v" (V-shaped:
# exactly two). Known here by name, so that the pre-check need not import torch's pipelining
# runtime (it imports torch._dynamo: over a second of CPU in every launch); a unit test holds the
# table to torch's classes.
SCHEDULES = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "multi",
    "LoopedBFS": "multi",
    "InterleavedZeroBubble": "multi",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
    "PipelineScheduleSingle": "single",
    "PipelineScheduleMulti": "multi",
}
# Base classes: they carry no order of their own, only the one a CSV file gives them.
CSV_ONLY = ("PipelineScheduleSingle", "PipelineScheduleMulti")
# The modules of a pipeline split besides the layers, in forward order around them.
FIRST_MODULES, LAST_MODULES = ("tok_embeddings",), ("norm", "output")


def schedule_kind(name: str) -> str:
    """'single', 'multi' or 'v' (SCHEDULES) for a schedule named in any case; refused in one line."""
    kinds = {s.lower(): kind for s, kind in SCHEDULES.items()}
    if name.lower() not in kinds:
        raise TitanError(
            f"config key 'parallelism.pipeline_parallel_schedule' got {name!r}; valid: {', '.join(SCHEDULES)}"
        )
    return kinds[name.lower()]


def check_schedule_config(par: Parallelism, evaluates: bool = False) -> None:
    """The schedule against torch's names and the CSV file on disk (run by
    titan.training.checks.validate_job; the ranges are Parallelism.validate's). ``evaluates``: the
    run also runs the schedule's forward-only ``eval`` (validation)."""
    schedule_kind(par.pipeline_parallel_schedule)
    if evaluates and par.pipeline_parallel_degree > 1 and is_v_schedule(par.pipeline_parallel_schedule):
        # torch 2.13's runtime hands a stage's input gradient to the adjacent stage on the same rank
        # even in eval, which has no backward: the first validation fails with an AssertionError.
        raise TitanError(
            f"validation.enable with parallelism.pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r}:"
            " torch 2.13's V-shaped schedules fail in eval (forward only); use Interleaved1F1B,"
            " InterleavedZeroBubble or 1F1B, or set validation.enable = false"
        )
    csv = par.pipeline_parallel_schedule_csv
    if csv and not os.path.isfile(csv):
        raise TitanError(f"config key 'parallelism.pipeline_parallel_schedule_csv' got {csv!r}: no such file")
    if not csv and par.pipeline_parallel_schedule.lower() in {s.lower() for s in CSV_ONLY}:
        raise TitanError(
            f"config key 'parallelism.pipeline_parallel_schedule' got {par.pipeline_parallel_schedule!r}, which runs"
            " the order of a CSV file: set parallelism.pipeline_parallel_schedule_csv, or name a schedule"
        )


def is_multi_stage(par) -> bool:
    """Multi-stage (looped) schedules run several stages per rank. As in torchtitan, the schedule's
    name decides, also when a CSV file gives the order (PipelineScheduleMulti with a CSV)."""
    return schedule_kind(par.pipeline_parallel_schedule) != "single"


def is_v_schedule(name: str) -> bool:
    return schedule_kind(name) == "v"


def num_stages(n_layers: int, pp: int, par) -> int:
    """Total (virtual) stages over all ranks: one per module_fqns_per_model_part entry; else from
    layers_per_stage, counting the embedding and the output as first/last_stage_less_layers layers
    (ceil((n_layers + first + last) / layers_per_stage)); else one stage per rank, two for looped schedules."""
    multi = is_multi_stage(par)
    lps = par.pipeline_parallel_layers_per_stage
    if par.module_fqns_per_model_part:
        stages, why = len(par.module_fqns_per_model_part), "parallelism.module_fqns_per_model_part has"
    elif lps != -1:
        units = n_layers + par.pipeline_parallel_first_stage_less_layers + par.pipeline_parallel_last_stage_less_layers
        stages = math.ceil(units / lps)
        why = (
            f"{n_layers} layers + embedding and output counted as {units - n_layers} at"
            f" pipeline_parallel_layers_per_stage {lps} make"
        )
    else:
        return pp * (2 if multi else 1)
    if stages % pp:
        raise TitanError(f"{why} {stages} pipeline stages, not a multiple of pipeline_parallel_degree {pp}")
    per_rank = stages // pp
    if not multi and per_rank != 1:
        raise TitanError(
            f"{why} {stages} pipeline stages, {per_rank} per rank, but schedule {par.pipeline_parallel_schedule}"
            " runs one stage per rank; use a looped schedule (Interleaved1F1B, ...) or fewer stages"
        )
    if is_v_schedule(par.pipeline_parallel_schedule) and per_rank != 2:
        raise TitanError(
            f"{why} {stages} pipeline stages, {per_rank} per rank, but the V-shaped schedule"
            f" {par.pipeline_parallel_schedule} runs exactly 2 per rank"
        )
    if multi and per_rank < 2:
        raise TitanError(
            f"{why} {stages} pipeline stages, 1 per rank, but schedule {par.pipeline_parallel_schedule} runs"
            " at least 2 per rank; use a single-stage schedule (1F1B, GPipe) or more stages"
        )
    return stages


def split_modules(n_layers: int, pp: int, par) -> list[list[str]]:
    """The module names of every stage (``layers.<i>``, tok_embeddings, norm, output): the given
    module_fqns_per_model_part, checked, or spread as torchtitan spreads them."""
    stages = num_stages(n_layers, pp, par)
    if par.module_fqns_per_model_part:
        return check_module_split(par.module_fqns_per_model_part, n_layers)
    return spread_modules(
        n_layers, stages, par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
    )


def spread_modules(n_layers: int, stages: int, first_less: int = 1, last_less: int = 1) -> list[list[str]]:
    """Stages of (nearly) equal units: the embedding counts as `first_less` layers and norm +
    output as `last_less`, so the first and last stage hold that many layers fewer; the remainder
    goes one unit each to the first stages. 6 layers over 8 stages: the embedding alone, one layer
    each, then norm + output alone."""
    units = n_layers + first_less + last_less
    base, extra = divmod(units, stages)
    if base == 0 or first_less > base or last_less > base:
        raise TitanError(
            f"model n_layers ({n_layers}) cannot be split into {stages} pipeline stages: with the embedding"
            f" counted as {first_less} layer(s) and the output as {last_less} (parallelism.pipeline_parallel_first/"
            f"last_stage_less_layers) a stage gets {base} unit(s) or {base + 1}, and the first and last stages"
            " need at least their own modules' count; lower parallelism.pipeline_parallel_degree (or raise"
            " pipeline_parallel_layers_per_stage)"
        )
    parts, layer = [], 0
    for s in range(stages):
        count = base + (s < extra) - (first_less if s == 0 else 0) - (last_less if s == stages - 1 else 0)
        names = [f"layers.{i}" for i in range(layer, layer + count)]
        layer += count
        parts.append([*FIRST_MODULES, *names] if s == 0 else [*names, *LAST_MODULES] if s == stages - 1 else names)
    return parts


def check_module_split(parts: list[list[str]], n_layers: int) -> list[list[str]]:
    """Stages run one after another, so the parts concatenated must be the model's modules in
    forward order, each once: tok_embeddings, layers.0 .. layers.<n-1>, norm, output."""
    order = [*FIRST_MODULES, *(f"layers.{i}" for i in range(n_layers)), *LAST_MODULES]
    flat = [name for part in parts for name in part]
    if flat != order or not all(parts):
        raise TitanError(
            f"config key 'parallelism.module_fqns_per_model_part' got {parts!r}; valid: non-empty lists that"
            f" together name tok_embeddings, layers.0 .. layers.{n_layers - 1}, norm, output once each, in that order"
        )
    return [list(part) for part in parts]


def stage_ids_this_rank(pp_rank: int, pp: int, stages: int, v_style: bool) -> list[int]:
    """Loop placement: rank r owns r, r+pp, ...; V placement (ZBV/DualPipeV): r and 2pp-1-r,
    so the last stage sits beside the first on rank 0."""
    per_rank = stages // pp
    if v_style:
        if per_rank != 2:
            raise TitanError(f"V-shaped schedules need exactly 2 stages per rank, got {per_rank}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def describe_stage(names: list[str]) -> str:
    """'layers 0-2 + embedding', 'layer 5 + output+loss', 'embedding', ..."""
    layers = [int(n.split(".", 1)[1]) for n in names if n.startswith("layers.")]
    pieces = []
    if layers:
        pieces.append(f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}")
    if "tok_embeddings" in names:
        pieces.append("embedding")
    if "output" in names:
        pieces.append("output+loss")
    elif "norm" in names:
        pieces.append("norm")
    if "mtp" in names:
        pieces.append("multi-token prediction")
    return " + ".join(pieces)


def describe_split(n_layers: int, parts: list[list[str]]) -> str:
    """One line naming the modules of every stage (logged at start-up)."""
    stages = "; ".join(f"stage {s}: {describe_stage(names)}" for s, names in enumerate(parts))
    return f"pipeline split of {n_layers} layers into {len(parts)} stages: {stages}"
