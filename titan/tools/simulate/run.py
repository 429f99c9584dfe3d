"""The simulator's run: check, plan, simulate one rank (at full depth or two shorter ones), report.

What is fake and what is not: the process group (torch's ``fake`` backend: every collective is
called with its real shapes, nothing is sent), the tensors (``FakeTensorMode``: shapes, dtypes and
sizes, no values, no memory); the model, its parallelization, the step (``Trainer.train_step``),
gradient clipping, the optimizer step and the checkpoint save plan are titan's own code. Values
that code reads from tensors are assumptions: expert parallelism's all-to-all split sizes are
balanced (times ``simulate.moe_imbalance`` for this rank's experts), other reads return 0.
torch.compile is not simulated (the eager model runs: compile usually needs less activation
memory), nor asynchronous TP (a compile pass).
"""

from __future__ import annotations

import dataclasses
import time

from titan.config.dialects import log_translations
from titan.config.job_config import JobConfig
from titan.log import init_logger
from titan.tools.simulate.depth import choose_depths, extrapolate
from titan.tools.simulate.estimate import estimate_categories
from titan.tools.simulate.report import Report, format_table, overflow_line, to_json
from titan.tools.simulate.step import simulate_step
from titan.training.checks import check_job
from titan.training.plan import RunPlan, plan_run

__all__ = ["main", "simulate"]

_GIB = 1024**3


def _eager(config: JobConfig) -> tuple[JobConfig, list[str]]:
    """The config the simulator runs (compile off) and what it changed."""
    notes = []
    if config.compile.enable:
        notes.append("torch.compile not simulated: the model runs eager (compile usually needs less activation memory)")
    if config.parallelism.enable_async_tensor_parallel:
        notes.append("asynchronous TP (a compile pass) not simulated: plain TP collectives")
    sim = dataclasses.replace(
        config,
        compile=dataclasses.replace(config.compile, enable=False),
        parallelism=dataclasses.replace(config.parallelism, enable_async_tensor_parallel=False),
    )
    sim.sources, sim.translations = config.sources, config.translations
    return sim, notes


def _title(config: JobConfig, plan: RunPlan) -> str:
    dims = plan.parallel_dims
    degrees = [f"{n} {getattr(dims, n)}" for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")]
    layout = ", ".join(d for d in degrees if not d.endswith(" 1")) or "one rank"
    return f"{config.model.name} {config.model.flavor} ({layout}), optimizer {config.optimizer.name}"


def simulate(config: JobConfig, world_size: int) -> Report:
    """Simulate rank ``config.simulate.rank`` of ``world_size`` ranks running ``config``."""
    t0 = time.perf_counter()
    # Checked as for the GPUs the simulation stands in for; tokenizer and data may live only there.
    check_job(config, world_size, "cuda", data_here=False)
    sim, notes = _eager(config)
    plan = plan_run(sim, world_size, "cuda", data_here=False)
    rank = config.simulate.rank
    depths = choose_depths(sim, plan, rank)
    if depths.short is None:
        record = simulate_step(sim, plan, rank)
        runs = [record.layers]
    else:
        one, two = (simulate_step(sim, plan, rank, keep) for keep in depths.short)
        record = extrapolate(one, two, len(depths.full))
        runs = [one.layers, two.layers]
    notes.insert(0, "fake process group (nothing sent) and fake tensors (no values, no memory); the step is titan's")
    if plan.parallel_dims.ep > 1:
        load = config.simulate.moe_imbalance
        notes.append(
            f"MoE routing assumed: balanced, this rank's experts receiving {load:g} x the mean (simulate.moe_imbalance)"
        )
    estimate, why = estimate_categories(config, world_size)
    return Report(
        title=_title(config, plan),
        world_size=world_size,
        rank=rank,
        record=record,
        estimate=estimate,
        estimate_note=why,
        layers_run=runs,
        extrapolated=depths.short is not None,
        seconds=time.perf_counter() - t0,
        device_memory_bytes=int(config.simulate.device_memory_gib * _GIB),
        notes=notes,
    )


def main(config: JobConfig, world_size: int) -> int:
    """Print the table and the JSON line; 1 when the rank does not fit simulate.device_memory_gib."""
    import sys

    init_logger(0)
    log_translations(config.translations)
    report = simulate(config, world_size)
    print(format_table(report), flush=True)
    line = overflow_line(report)
    if line is not None:
        print(f"titan: {line}", file=sys.stderr, flush=True)
    print(to_json(report), flush=True)
    return 0 if line is None else 1
