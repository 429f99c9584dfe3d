"""The rank's step as a sequence of moments, each with its bytes by category; the estimate is the
highest moment's (the categories are those the scale simulator reports, titan/tools/simulate).

Every moment holds the parameters and the optimizer state. Forward and backward add, window by
window (titan/training/memory/profile.py), what the micro-batches in flight keep and the open
window's highest moment, mapped from the profile's labels to the layout's categories:

- tensor parallelism with sequence parallelism divides a block's own work, the embedding's output
  and the routed experts' hidden states by TP; a sub-layer's normed input is all-gathered over the
  sequence before it is used (``communication``, whole); an MoE layer's router and routing work on
  the gathered tokens (whole); the loss on vocabulary-sharded logits (divided by TP with loss
  parallel). Context parallelism is in the profile's tokens (the sequence over CP).
- parameter gradients: a block's unsharded gradients scale from the measured (whole) block to the
  rank's slice of it (its FSDP units' unsharded elements; under EP its own experts only). Under
  FSDP they live in the block's backward (``activations``) until its reduce-scatter leaves the
  sharded gradient (``gradients``); without FSDP they are the gradients.
- FSDP's buffers (``communication``): the root unit (embedding, final norm, output) stays gathered
  through forward and backward; a block is gathered for its forward and again for its backward,
  with the next block's all-gather in flight (backward prefetch) and the previous block's
  reduce-scatter input held until the next reduce-scatter is issued (a block's nested units, its
  routed experts in a unit of their own, reduce-scatter before the block's own); the root's
  reduce-scatter comes last. Blocks not resharded after forward (``fsdp_reshard_after_forward = never``, and under
  PP) stay gathered, those of every stage of the rank that has run a forward; under PP the
  unsharded gradients also accumulate, in the reduce dtype, over all micro-batches of a stage, and
  both go at the stage's gradient reduction after its last micro-batch's backward.
- pipeline parallelism: the schedule's own action order for this rank (torch's ``pipeline_order``:
  forward F, backward B or I then W, per stage and micro-batch) decides which micro-batches are in
  flight; each stage keeps one receive buffer per micro-batch for its input and one for its
  output's gradient.

The micro-batches after the first hold every sharded gradient from the start; the step's later
phases are gradient clipping (parameters, gradients, optimizer state) and the optimizer step (the
same plus its temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan.parallel.dims import ParallelDims
from titan.training.memory.labels import LabelMap
from titan.training.memory.layout import ROOT, RankModel
from titan.training.memory.profile import LABELS, Profile, Window

__all__ = ["CATEGORIES", "Moment", "Step", "walk"]

CATEGORIES: tuple[str, ...] = (
    "parameters",
    "gradients",
    "optimizer_state",
    "optimizer_aux",
    "activations",
    "communication",
    "loss",
)


@dataclass
class Moment:
    name: str
    bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))

    @property
    def total(self) -> float:
        return sum(self.bytes.values())


@dataclass
class Step:
    """What the walk needs besides the rank and the profile."""

    dims: ParallelDims
    micro_batches: int  # gradient accumulation steps (PP: schedule runs per optimizer step)
    pp_micro_batches: int  # micro-batches of one pipeline schedule run (1 without PP)
    reshard_after_forward: bool
    optimizer_state: int
    optimizer_aux: int
    recv_bytes: int = 0  # one PP receive buffer (a micro-batch's stage input), 0 without PP
    kept_comm: int = 0  # collective outputs a block keeps for its backward (TP's reduce-scatters under per-op SAC)
    kept_comm_moe: int = 0  # what an MoE block keeps on top (EP's dispatching all-to-all under per-op SAC)


# What an MoE layer's backward makes (gone when its routed experts reduce-scatter their gradients).
_MOE_BACKWARD = frozenset({"router", "moe", "experts", "routed_out", "grads"})


def _sum(units: list, what: str) -> int:
    return sum(getattr(u, what) for u in units if u.fsdp)


class _Walk:
    def __init__(self, rank: RankModel, profile: Profile, step: Step, labels: LabelMap) -> None:
        self.rank, self.profile, self.step, self.labels = rank, profile, step, labels
        dims = step.dims
        self.tp, self.fsdp = dims.tp, dims.fsdp_enabled
        self.window = rank.windows()
        self.root_grads = sum(u.grad for u in rank.units.get(ROOT, []))
        self.gathered = {k: _sum(us, "gathered") for k, us in rank.units.items()}
        self.reduce = {k: _sum(us, "reduce") for k, us in rank.units.items()}
        # A block's own FSDP unit (its first; units nested in it, EP's experts, follow): the
        # backward prefetch and the held reduce-scatter are the neighbouring blocks' own units.
        self.outer_gathered = {k: _sum(us[:1], "gathered") for k, us in rank.units.items()}
        self.outer_reduce = {k: _sum(us[:1], "reduce") for k, us in rank.units.items()}
        self.nested_reduce = {k: _sum(us[1:], "reduce") for k, us in rank.units.items()}
        self.sharded = {k: sum(u.held for u in us) for k, us in rank.units.items()}  # gradients like parameters
        params = rank.total("held") + sum(
            rank.buffers.get(k, 0) * (1 if k == ROOT else rank.count(k)) for k in rank.buffers
        )
        self.static = {"parameters": float(params), "optimizer_state": float(step.optimizer_state)}
        self.moments: list[Moment] = []
        self.running = dict.fromkeys(LABELS, 0)
        self.grads = 0.0  # sharded gradients held (or whole ones without FSDP)
        self.done: set[tuple[int, int]] = set()  # (stage, layer) whose gradients exist
        self.kept_comm = 0.0  # collective outputs the blocks in flight keep
        self.accumulated = 0.0  # PP x FSDP: unsharded gradients accumulated over the micro-batches
        # Blocks not resharded after forward: how many of each stage's are gathered; a stage's stay
        # gathered (and its unsharded gradients accumulate) until its last micro-batch's backward.
        self.held: dict[int, int] = {}
        self.accumulating: dict[int, set[int]] = {}  # stage -> blocks whose gradients accumulate
        self.backwards: dict[int, int] = {}  # stage -> backwards run in this schedule run

    # ------------------------------------------------------------ labels -> categories
    def _moment(self, name: str, window: Window, block: int, comm: float) -> None:
        labels = {k: self.running[k] + window.peak[k] for k in LABELS}
        cats = self.labels.categories(labels, None if block == ROOT else block, CATEGORIES)
        m = Moment(name)
        for k in CATEGORIES:
            m.bytes[k] = max(0.0, cats[k]) + self.static.get(k, 0.0)
        m.bytes["gradients"] += self.grads
        m.bytes["communication"] += comm + self.accumulated + self._recv() + self.kept_comm
        self.moments.append(m)
        for k in LABELS:
            self.running[k] += window.kept[k]
        kept = self.step.kept_comm + (self.step.kept_comm_moe if block in self.rank.moe else 0)
        if name.startswith("forward "):
            self.kept_comm += kept
        elif name.startswith("backward "):
            self.kept_comm -= kept

    def _recv(self) -> float:
        stages = len(self.rank.stages)
        first, last = self.rank.has_first, self.rank.has_last
        per_stage = 2 * stages - (1 if first else 0) - (1 if last else 0)
        return float(per_stage * self.step.pp_micro_batches * self.step.recv_bytes)

    # ------------------------------------------------------------ FSDP's buffers
    def _root(self) -> float:
        return float(self.gathered.get(ROOT, 0))

    def _held_gathered(self) -> float:
        """Blocks that stay gathered (not resharded after forward): every stage's blocks run so far."""
        if self.step.reshard_after_forward:
            return 0.0
        kind, stages = self.rank.kind, self.rank.stages
        return float(sum(self.gathered[kind[i]] for s, n in self.held.items() for i in stages[s][:n]))

    def _hold(self, stage: int, blocks: int) -> None:
        self.held[stage] = max(self.held.get(stage, 0), blocks)

    def _stage_done(self, stage: int) -> None:
        """After a stage's last backward of the schedule run: its gradient reduction frees its
        accumulated gradients (leaving the sharded ones) and reshards its blocks."""
        self.backwards[stage] = self.backwards.get(stage, 0) + 1
        if self.step.dims.pp == 1 or self.backwards[stage] < self.step.pp_micro_batches:
            return
        self.backwards[stage] = 0
        self.held.pop(stage, None)
        for i in self.accumulating.pop(stage, set()):
            k = self.rank.kind[i]
            self.accumulated -= self.reduce[k]
            if (stage, i) not in self.done:
                self.done.add((stage, i))
                self.grads += self.sharded[k]

    # ------------------------------------------------------------ actions
    def forward(self, stage: int) -> None:
        ids = self.rank.stages[stage]
        p = self.profile
        if stage == min(self.rank.stages) and self.rank.has_first:
            self._moment("embedding", p.embed, ROOT, self._root())
        for n, i in enumerate(ids):
            self._hold(stage, n + 1)
            comm = self._root() + self._held_gathered()
            if self.step.reshard_after_forward:
                comm += self.gathered[self.rank.kind[i]]
            self._moment(f"forward {i}", p.forward[self.window[i]], i, comm)
        if stage == max(self.rank.stages) and self.rank.has_last:
            self._moment("loss", p.head, ROOT, self._root() + self._held_gathered())

    def backward(self, stage: int) -> None:
        ids = self.rank.stages[stage]
        p, kind, pp = self.profile, self.rank.kind, self.step.dims.pp > 1
        for n in range(len(ids) - 1, -1, -1):
            i, k = ids[n], kind[ids[n]]
            if self.step.reshard_after_forward:
                comm = self.gathered[k] + (self.outer_gathered[kind[ids[n - 1]]] if n > 0 else 0)
            else:
                comm = self._held_gathered()
            later = self.outer_reduce[kind[ids[n + 1]]] if not pp and n + 1 < len(ids) else 0
            self._moment(f"backward {i}", p.backward[self.window[i]], i, self._root() + comm + later)
            if not pp and self.nested_reduce[k] > later:
                # The block's nested units (its routed experts in a unit of their own) reduce-scatter
                # first, once the MoE layer's backward is done: their input is held, in place of the
                # later block's, through the rest of the block's backward (its own work's peak).
                window = p.backward[self.window[i]]
                rest = {k: 0 if k in _MOE_BACKWARD else v for k, v in window.peak.items()}
                self._moment(f"reduce-scatter {i}", Window(peak=rest), i, self._root() + comm + self.nested_reduce[k])
            if pp and self.fsdp:
                if i not in self.accumulating.setdefault(stage, set()):
                    self.accumulating[stage].add(i)
                    self.accumulated += self.reduce[k]
            elif (stage, i) not in self.done:
                self.done.add((stage, i))
                self.grads += self.sharded[k]
        if stage == min(self.rank.stages) and self.rank.has_first:
            held = self.outer_reduce[kind[ids[0]]] if ids and not pp else 0
            # under TP the whole-vocabulary gradient's reduce-scatter to this rank's rows
            rows = p.tail.peak["root_grads"] * self.labels.root_share if self.tp > 1 else 0
            self._moment("embedding backward", p.tail, ROOT, self._root() + held + rows)
            if self.fsdp and not pp:  # the root unit's reduce-scatter: its unsharded gradients, in and out
                m = Moment("root reduce-scatter", {**self.moments[-1].bytes})
                m.bytes["activations"] = float(self.root_grads)
                m.bytes["loss"] = 0.0
                m.bytes["communication"] = self._root() + self.reduce.get(ROOT, 0) + self._recv()
                self.moments.append(m)
        if (stage, ROOT) not in self.done and stage == min(self.rank.stages):
            self.done.add((stage, ROOT))
            self.grads += self.sharded.get(ROOT, 0)
        self._stage_done(stage)

    def finish(self) -> None:
        """Gradient clipping, then the optimizer step, on every gradient (sharded like its parameter)."""
        for name, aux in (("clip", 0), ("optimizer", self.step.optimizer_aux)):
            m = Moment(name)
            for k, v in self.static.items():
                m.bytes[k] = v
            m.bytes["gradients"] = float(self.rank.total("held"))
            m.bytes["optimizer_aux"] = float(aux)
            self.moments.append(m)


def walk(rank: RankModel, profile: Profile, step: Step, labels: LabelMap) -> list[Moment]:
    """The moments of one optimizer step of ``rank`` (two micro-batches stand for all: the second
    holds the first's gradients, as every later one does)."""
    w = _Walk(rank, profile, step, labels)
    if rank.order is None:
        for _ in range(min(step.micro_batches, 2)):
            w.forward(0)
            w.backward(0)
    else:
        for _ in range(min(step.micro_batches, 2)):
            for action, stage, _mb in rank.order:
                if action == "F":
                    w.forward(stage)
                elif action in ("B", "I"):
                    w.backward(stage)
    w.finish()
    return w.moments
