"""One training step of one rank under the trackers: memory by category, collectives, host reads.

``simulate_step`` builds the rank in a fake world (torch's ``fake`` process-group backend, the dry
run's ``fake_world``: this process is rank r of N, nothing is sent) with fake tensors
(``FakeTensorMode``: shapes, dtypes and storages' sizes, no values, no memory), runs
``Trainer.train_step`` on it, then plans its checkpoint save. ``measure_step`` runs the same on a
real process group with real tensors (the reference a simulation is checked against).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.parallel.dims import ParallelDims
from titan.tools.dry_run import fake_world
from titan.tools.simulate.attach import attach
from titan.tools.simulate.checkpoint_plan import plan_save
from titan.tools.simulate.collectives import CollectiveTracker, group_labels
from titan.tools.simulate.ddp import hook_ddp
from titan.tools.simulate.memory import MemoryTracker, PhasePeak
from titan.tools.simulate.pipeline import static_stage_shapes
from titan.tools.simulate.rank import SimulatedRank
from titan.tools.simulate.reads import HostReads
from titan.training.memory.attention import cuda_attention
from titan.training.plan import RunPlan

__all__ = ["StepRecord", "measure_step", "simulate_step"]

_CPU = torch.device("cpu")
_REAL_LIMIT = 2 * 1024**3  # parameter bytes a real-tensor rank may hold (x4 with gradients and AdamW)
# Phases of a step, in order.
PHASES = ("forward_backward", "clip", "optimizer")


@dataclass
class StepRecord:
    """What one step of one rank did (a step after the first: the optimizer state exists). ``peaks``:
    each phase's peak; ``activation_peaks``: each phase's moment of most activations."""

    layers: int  # transformer blocks this rank ran
    tensors: str  # "fake", or "real" where torch needs tensor data (DDP)
    peaks: dict[str, PhasePeak]
    collectives: dict[tuple[str, str], list[float]]
    host_reads: dict[str, int]
    step_seconds: float
    checkpoint: dict[str, int] = field(default_factory=dict)
    activation_peaks: dict[str, PhasePeak] = field(default_factory=dict)

    @property
    def peak(self) -> tuple[str, PhasePeak]:
        phase = max(self.peaks, key=lambda p: self.peaks[p].total)
        return phase, self.peaks[phase]


def _labels(dims: ParallelDims) -> dict[str, str]:
    named: dict[str, dist.ProcessGroup | None] = {}
    for name in ("tp", "cp", "dp_shard", "dp_replicate", "pp", "dp_shard_cp", "dp", "dp_cp"):
        mesh = dims.submesh(name)
        named[name] = mesh.get_group() if mesh is not None else None
    for name in ("ep", "etp", "efsdp"):
        mesh = dims.sparse_submesh((name,))
        named[name] = mesh.get_group() if mesh is not None and mesh.size() > 1 else None
    named["world"] = dist.group.WORLD
    return group_labels(named)


def _run(rank: SimulatedRank, fake: bool) -> StepRecord:
    memory, comms, reads = MemoryTracker(), CollectiveTracker(_labels(rank.parallel_dims)), HostReads()
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    # a real run computes: the CPU's own kernels; a fake one stands for a CUDA rank
    kernels = cuda_attention() if fake else contextlib.nullcontext()
    with mode, kernels, reads, memory, comms:
        if isinstance(mode, FakeTensorMode):
            mode.allow_non_fake_inputs = True  # the meta model's tensors become fake ones here
        rank.materialize(seed=None if fake else 0)
        if isinstance(mode, FakeTensorMode):
            mode.allow_non_fake_inputs = False
        for experts in rank.experts:  # expert parallelism's assumed routing (titan/parallel/expert_parallel.py)
            setattr(experts, "simulated_load", rank.config.simulate.moe_imbalance)  # noqa: B010
        static_stage_shapes(rank, reads)
        hook_ddp(rank)
        with memory.region("optimizer_aux"):
            _optimizer_state(rank)
        attach(memory, rank)
        batch = rank.batch()
        memory.default = "activations"
        memory.phase("forward_backward")
        comms.counting = reads.counting = True
        t0 = time.perf_counter()
        rank.train_step(batch)
        seconds = time.perf_counter() - t0
        comms.counting = reads.counting = False
    # DCP's planning reads only the state's metadata; the shard offsets it computes from index
    # tensors are host values: planned outside the fake mode (where they would have no value).
    checkpoint = plan_save(rank, dist.get_rank() == 0)
    peaks = {p: memory.peaks[p] for p in PHASES if p in memory.peaks}
    most = {p: memory.activation_peaks[p] for p in PHASES if p in memory.activation_peaks}
    layers = sum(len(getattr(part, "layers", {})) for part in rank.model_parts)
    tensors = "fake" if fake else "real"
    return StepRecord(layers, tensors, peaks, dict(comms.calls), dict(reads.reads), seconds, checkpoint, most)


def _optimizer_state(rank: SimulatedRank) -> None:
    """Make the optimizers' state as a first step would (one step on zero gradients), so the step
    measured is a later one: it starts with the state held and the optimizers' lazy set-up done."""
    for p in rank._params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    rank.optimizers.step()
    rank.optimizers.zero_grad()
    rank.train_state.step = 2


def simulate_step(config: JobConfig, plan: RunPlan, rank: int, keep_layers: Sequence[int] | None = None) -> StepRecord:
    """Rank ``rank`` of the plan's world, fake: one step, then its checkpoint save plan."""
    with fake_world(rank, plan.parallel_dims.world_size):
        dims = dataclasses.replace(plan.parallel_dims)  # the plan's layout with a mesh of this world
        dims.build_mesh("cpu")
        sim = SimulatedRank(config, plan, dims, _CPU, keep_layers)
        real = dims.dp_replicate_enabled and not dims.fsdp_enabled
        if real:
            _check_real_size(sim)
        return _run(sim, fake=not real)


def _check_real_size(rank: SimulatedRank) -> None:
    """torch's DDP builds its gradient buckets from tensor data, so DDP layouts run real tensors:
    this rank's model, gradients and optimizer state must fit this machine."""
    params = sum(p.numel() * p.element_size() for part in rank.model_parts for p in part.parameters())
    if params > _REAL_LIMIT:
        raise TitanError(
            f"scripts/simulate.py runs DDP layouts (data_parallel_replicate_degree without FSDP) with real"
            f" tensors (torch's DDP reducer reads tensor data), and this rank holds {params / 2**30:.1f} GiB of"
            f" parameters, above the {_REAL_LIMIT / 2**30:g} GiB this simulator allocates; simulate HSDP"
            " (data_parallel_shard_degree > 1) or a smaller model"
        )


def measure_step(config: JobConfig, plan: RunPlan, dims: ParallelDims) -> StepRecord:
    """The same on this process's real process group (initialized by the caller; ``dims`` with its
    mesh built) with real tensors: the reference measurement."""
    return _run(SimulatedRank(config, plan, dims, _CPU), fake=False)
