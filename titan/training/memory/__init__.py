"""Per-rank training memory, estimated in seconds for any layout, in the scale simulator's categories.

The estimate puts together three pieces, each in its module:

- layout.py: what the rank holds. Its model is built as the trainer builds it, on the meta device in
  a fake process group (one block per kind and pipeline stage): every parameter shard, FSDP unit,
  all-gather output and reduce-scatter input of the rank, for FSDP, HSDP, DDP, TP/SP, PP (any
  schedule), CP, EP and ETP and their combinations.
- profile.py: what a micro-batch makes. One forward, loss and backward of those blocks, whole, on
  fake tensors at the rank's tokens per micro-batch, in the trainer's precision, activation
  checkpointing, loss and float8: what each block keeps for its backward and what each piece adds
  at its highest moment, by where it was made.
- timeline.py: the rank's step as moments (each block's forward and backward in the rank's order,
  the pipeline schedule's micro-batches in flight, gradient clipping, the optimizer step), each the
  sum of parameters, optimizer state (optimizer.py), gradients held, activations and buffers; the
  estimate is the highest moment.

Categories (``CATEGORIES``, the simulator's keys): parameters (shards and model buffers), gradients
(gradients held), optimizer_state, optimizer_aux (the optimizer step's temporaries), activations,
communication (FSDP's gathered parameters and reduce-scatter inputs, TP's gathered sequences, PP's
receive buffers), loss (logits and the loss's tensors). Not modelled: allocator caching and
fragmentation (compare with max_memory_allocated, not reserved), NCCL's own buffers, CUDA context
and kernel workspaces, torch.compile (usually less activation memory: the estimate is eager's).
activation_checkpoint.mode = memory_budget is counted between the full and the uncheckpointed
profiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from titan.checkpointing.snapshot_budget import snapshot_host_bytes
from titan.config.job_config import JobConfig
from titan.errors import TitanError
from titan.parallel.fsdp import DTYPES, reshard_policy
from titan.training.memory.labels import LabelMap, label_map
from titan.training.memory.layout import RankModel, build_rank
from titan.training.memory.live import LiveBytes, measure_peak
from titan.training.memory.optimizer import optimizer_bytes
from titan.training.memory.profile import Profile, Window, profile_step
from titan.training.memory.timeline import CATEGORIES, Moment, Step, walk

__all__ = ["CATEGORIES", "LiveBytes", "MemoryEstimate", "estimate_memory", "measure_peak"]

_PHASES = {"clip": "clip", "optimizer": "optimizer step"}


@dataclass
class MemoryEstimate:
    world_size: int
    rank: int
    layout: str
    params: int
    """Parameter elements this rank holds (padded FSDP shards)."""
    categories: dict[str, int]
    """Bytes by category at the rank's peak, and ``total``."""
    peak_moment: str
    forward_backward: dict[str, int]
    """Bytes by category at forward/backward's highest moment, and ``total``."""
    phase_peaks: dict[str, int]
    """Each phase's highest total: forward/backward, clip, optimizer step."""
    optimizer_states: str = "AdamW, 2 x fp32"
    notes: list[str] = field(default_factory=list)
    moments: list[Moment] = field(default_factory=list, repr=False)
    """The rank's step, moment by moment (titan/training/memory/timeline.py)."""

    @property
    def total_bytes(self) -> int:
        return self.categories["total"]

    @property
    def peak_phase(self) -> str:
        return _PHASES.get(self.peak_moment, "forward/backward")

    @property
    def activation_bytes(self) -> int:
        """What forward/backward adds at its highest moment besides parameters, optimizer state and
        communication buffers: activations, the loss's tensors and the gradients so far."""
        fb = self.forward_backward
        return fb["activations"] + fb["loss"] + fb["gradients"]

    def rows(self) -> list[tuple[str, float]]:
        return [
            *((k, float(self.categories[k])) for k in CATEGORIES),
            (f"total (at {self.peak_moment})", float(self.total_bytes)),
            # in host memory (a tmpfs), so outside the device total: two slots of the state and a peer's
            ("host, not in total: memory snapshots", snapshot_host_bytes(self._state_bytes())),
        ]

    def _state_bytes(self) -> int:
        return self.categories["parameters"] + self.categories["optimizer_state"]


def _check_supported(config: JobConfig) -> None:
    """The estimate models device-resident fp32 states with a whole-model gradient: refuse the rest."""
    if config.optimizer.bf16_stochastic_round:
        raise TitanError(
            "the memory estimator models fp32 parameters and optimizer states, not"
            " optimizer.bf16_stochastic_round (bf16 parameters); set it to false to estimate"
        )
    for key, on in (
        ("training.enable_cpu_offload", config.training.enable_cpu_offload),
        ("optimizer.early_step_in_backward", config.optimizer.early_step_in_backward),
    ):
        if on:
            raise TitanError(
                f"the memory estimator models device-resident states with a whole-model gradient,"
                f" not {key}; set it to false to estimate"
            )


def _blend(a: Profile, b: Profile, w: float) -> Profile:
    """Window by window, ``a`` + w x (``b`` - ``a``)."""

    def mix(x: Window, y: Window) -> Window:
        return Window(
            {k: round(x.kept[k] + w * (y.kept[k] - x.kept[k])) for k in x.kept},
            {k: round(x.peak[k] + w * (y.peak[k] - x.peak[k])) for k in x.peak},
        )

    return dataclasses.replace(
        a,
        embed=mix(a.embed, b.embed),
        forward={i: mix(a.forward[i], b.forward[i]) for i in a.forward},
        head=mix(a.head, b.head),
        backward={i: mix(a.backward[i], b.backward[i]) for i in a.backward},
        tail=mix(a.tail, b.tail),
    )


def _profile(config: JobConfig, plan, rank: RankModel, labels: LabelMap) -> Profile:
    """The micro-batch's windows at this rank's tokens (the sequence over CP)."""
    dims, t = plan.parallel_dims, config.training
    batch = config.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else t.local_batch_size
    keep = sorted(set(rank.windows().values()))

    def run(c: JobConfig) -> Profile:
        return profile_step(
            plan.spec.model_cls,
            plan.model_args,
            c,
            fsdp=dims.fsdp_enabled,
            keep=keep,
            batch=batch,
            seq=t.seq_len // dims.cp,
            loss_parallel=dims.loss_parallel_enabled,
            whole=rank.whole,
            weights=labels.weights,
        )

    ac = config.activation_checkpoint
    if ac.mode != "memory_budget":
        return run(config)
    # compile's partitioner keeps memory_budget of the way from recomputing everything (about full
    # checkpointing) to its default choice (at most no checkpointing).
    full, none = (
        run(dataclasses.replace(config, activation_checkpoint=dataclasses.replace(ac, mode=m)))
        for m in ("full", "none")
    )
    return _blend(full, none, ac.memory_budget)


def _at(moments: list[Moment], names: set[str] | None = None) -> Moment:
    chosen = [m for m in moments if names is None or m.name in names]
    return max(chosen, key=lambda m: m.total)


def _with_total(m: Moment) -> dict[str, int]:
    out = {k: int(v) for k, v in m.bytes.items()}
    out["total"] = sum(out.values())
    return out


def estimate_memory(config: JobConfig, world_size: int) -> MemoryEstimate:
    """Bytes of rank ``simulate.rank`` (default 0) of ``world_size`` ranks training ``config``."""
    from titan.training.plan import plan_run

    _check_supported(config)
    plan = plan_run(config, world_size, "cuda", data_here=False)
    dims, t = plan.parallel_dims, config.training
    rank = build_rank(config, plan, config.simulate.rank)
    compute = DTYPES[t.mixed_precision_param] if dims.fsdp_enabled else DTYPES["float32"]
    labels = label_map(rank, dims, compute.itemsize, config.simulate.moe_imbalance)
    profile = _profile(config, plan, rank, labels)
    state, aux, what = optimizer_bytes(rank, config)
    pp_micro = t.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else 1
    batch = config.parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else t.local_batch_size
    # one micro-batch's hidden states on this rank: a stage's input, a sequence-sharded TP output
    hidden = batch * t.seq_len // (dims.cp * dims.tp) * plan.model_args.dim * DTYPES[t.mixed_precision_param].itemsize
    moe_args = getattr(plan.model_args, "moe_args", None)
    top_k = moe_args.top_k if moe_args is not None else 0
    # the routed copies of one micro-batch's tokens (gathered over TP for the MoE layer)
    routed = batch * t.seq_len // dims.cp * top_k * plan.model_args.dim * DTYPES[t.mixed_precision_param].itemsize
    ac = config.activation_checkpoint
    per_op = ac.mode == "selective" and ac.selective_ac_option == "op"
    step = Step(
        dims=dims,
        micro_batches=plan.grad_accum_steps,
        pp_micro_batches=pp_micro,
        reshard_after_forward=reshard_policy(config.parallelism.fsdp_reshard_after_forward, dims.pp > 1),
        optimizer_state=state,
        optimizer_aux=aux,
        recv_bytes=hidden if dims.pp > 1 else 0,
        # per-op SAC keeps every reduce-scatter's output: TP's two per block (attention, feed-forward)
        kept_comm=2 * hidden if per_op and dims.tp > 1 else 0,
        # and both of EP's all-to-alls per MoE block: the dispatching one's output (the routed copies
        # this rank's experts receive, times their load) and the combining one's (every routed copy
        # of the micro-batch's tokens, back on this rank)
        kept_comm_moe=round(routed * (1 + config.simulate.moe_imbalance)) if per_op and dims.ep > 1 else 0,
    )
    moments = walk(rank, profile, step, labels)
    peak = _at(moments)
    fb = _at(moments, {m.name for m in moments if m.name not in _PHASES})
    phases = {"forward/backward": int(fb.total)} | {_PHASES[m.name]: int(m.total) for m in moments if m.name in _PHASES}
    degrees = [f"{n} {getattr(dims, n)}" for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")]
    return MemoryEstimate(
        world_size=world_size,
        rank=config.simulate.rank,
        layout=", ".join(d for d in degrees if not d.endswith(" 1")) or "one rank",
        params=rank.total("numel"),
        categories=_with_total(peak),
        peak_moment=peak.name,
        forward_backward=_with_total(fb),
        phase_peaks=phases,
        optimizer_states=what,
        moments=moments,
    )
