"""Training stability: non-finite policy, loss / grad-norm spike detection, parameter norm.

Two signals are watched against their running averages (relative margins): the grad norm and the
loss. ``StabilityMonitor`` counts spike *events* and how many steps each lasted, and applies the
``training.nonfinite`` policy. Steps that log nothing make no host read: the non-finite decision
and its record stay on the device (the update itself is masked by titan/training/nonfinite.py);
log steps read the logged values and that record together, once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan.config.sections.stability import Stability
from titan.errors import TitanError
from titan.log import logger
from titan.parallel.utils import global_l2_norm

__all__ = ["SpikeDetector", "StabilityMonitor", "StepResult", "StepValues", "param_norm"]


@dataclass
class StepResult:
    """One step's logged tensors, still on the device: ``loss`` (summed over the dp x cp ranks on log
    steps only), ``grad_norm`` (before clipping) and ``extra`` (param_norm on the steps that log it),
    read into ``StepValues`` by ``StabilityMonitor.read`` on log steps. Unpacks as the pair
    ``(loss, grad_norm)`` for callers that drive steps themselves (tests, tools)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    extra: dict[str, torch.Tensor]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter((self.loss, self.grad_norm))

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.loss, self.grad_norm)[index]


class SpikeDetector:
    """Spike: value > avg * (1 + margin) (relative) or value > avg + margin (absolute), where avg is
    the mean of the previous ``window`` finite values (spike steps included, so a lasting shift
    stops counting as a spike once the average catches up). Needs a full window before judging
    (the warm-up).

    ``events``: spikes counted once per run of consecutive spike steps; ``spike_steps``: all steps
    in a spike; ``longest``: longest run; ``durations``: length of every finished event.
    """

    def __init__(self, name: str, window: int, threshold: float, relative: bool) -> None:
        self.name = name
        self.threshold = threshold
        self.relative = relative
        self.history: deque[float] = deque(maxlen=window)
        self.events = 0
        self.spike_steps = 0
        self.longest = 0
        self.current = 0
        self.durations: list[int] = []

    def limit(self) -> float | None:
        if len(self.history) < (self.history.maxlen or 0):
            return None
        avg = sum(self.history) / len(self.history)
        return avg * (1.0 + self.threshold) if self.relative else avg + self.threshold

    def update(self, step: int, value: float) -> bool:
        """Feed one step's value; returns True when this step is (part of) a spike."""
        limit = self.limit()
        spike = limit is not None and value > limit
        if spike:
            if self.current == 0:
                self.events += 1
                logger.warning(
                    f"{self.name} spike at step {step}: {value:.4g} > {limit:.4g} (running average"
                    f" {sum(self.history) / len(self.history):.4g} over {len(self.history)} values)"
                )
            self.current += 1
            self.spike_steps += 1
            self.longest = max(self.longest, self.current)
        elif self.current:
            self.durations.append(self.current)
            logger.warning(f"{self.name} spike ended at step {step} after {self.current} step(s)")
            self.current = 0
        self.history.append(value)
        return spike

    def scalars(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}_spikes": float(self.events),
            f"{prefix}_spike_steps": float(self.spike_steps),
            f"{prefix}_spike_longest": float(self.longest),
        }


@dataclass(frozen=True)
class StepValues:
    """A log step's values on the host: the loss, the grad norm and the other logged scalars."""

    loss: float
    grad_norm: float
    extra: dict[str, float]


# Device-side record (float64, exact for step numbers below 2**53): one vector so a log step reads
# it together with the logged values.
_SKIPPED, _IN_A_ROW = 0, 1  # steps skipped so far; non-finite steps in a row
_FIRST, _LAST, _LIMIT = 2, 5, 8  # (step, loss, grad_norm) of the first / latest non-finite step and
# of the step that went over nonfinite_max_consecutive_skips (step 0: none yet)
_GN_MAX, _GN_MAX_STEP = 11, 12  # largest finite grad norm since the last log step, and its step
_STATE_SIZE = 13


class StabilityMonitor:
    """The trainer's stability bookkeeping, with no host read on steps that log nothing.

    ``check(step, loss, grad_norm)`` (between clipping and the optimizer step) returns the decision to
    apply the update as a bool tensor on the device and updates the device-side record (skips, the
    first non-finite step, the largest grad norm since the last log). ``read(step, values)`` on a log
    step brings the logged values and that record to the host in one read, then reports (raises for
    ``stop`` or too many skips in a row, warns about skips) and feeds the spike detectors.
    ``resolve(step)`` does the same for the record alone (before a checkpoint save, validation and at
    the end of training), so a stopped run never writes a checkpoint after a non-finite step.
    """

    def __init__(self, s: Stability, *, nonfinite: str, max_consecutive_skips: int) -> None:
        """``s``: the [stability] section; ``nonfinite`` and ``max_consecutive_skips``: training.nonfinite
        and training.nonfinite_max_consecutive_skips."""
        self.policy = nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.grad_norm = SpikeDetector(
            "grad-norm", s.grad_norm_spike_window, s.grad_norm_spike_threshold, relative=True
        )
        self.loss = SpikeDetector("loss", s.loss_spike_window, s.loss_spike_threshold, relative=True)
        self.skipped_steps = 0  # host copy, as of the last read
        self._state: torch.Tensor | None = None
        self._unread = False  # steps checked since the record was last read

    def _record(self, device: torch.device) -> torch.Tensor:
        if self._state is None:
            self._state = torch.zeros(_STATE_SIZE, dtype=torch.float64, device=device)
            self._state[_GN_MAX] = -math.inf
        return self._state

    @torch.no_grad()
    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The decision to apply this step's update (a 0-dim bool tensor on the device; no host read).

        ``grad_norm`` (before clipping) is global: the same on every rank. ``loss`` may be this rank's
        share; a non-finite loss makes that rank's gradients, hence the global grad norm, non-finite,
        so all ranks decide alike without another collective."""
        state = self._record(grad_norm.device)
        x = torch.stack([loss.detach().reshape(()), grad_norm.detach().reshape(())]).to(torch.float64)
        finite = torch.isfinite(x)
        ok = finite.all()
        bad = ~ok
        row = torch.cat([x.new_full((1,), step), x])  # (step, loss, grad_norm)
        new = state.clone()
        new[_SKIPPED] += bad
        new[_IN_A_ROW] = (state[_IN_A_ROW] + 1) * bad
        first = bad & (state[_FIRST] == 0)
        new[_FIRST : _FIRST + 3] = torch.where(first, row, state[_FIRST : _FIRST + 3])
        new[_LAST : _LAST + 3] = torch.where(bad, row, state[_LAST : _LAST + 3])
        over = (new[_IN_A_ROW] > self.max_consecutive_skips) & (state[_LIMIT] == 0)
        new[_LIMIT : _LIMIT + 3] = torch.where(over, row, state[_LIMIT : _LIMIT + 3])
        higher = ok & (x[1] > state[_GN_MAX])  # skipped steps never reach the spike detectors
        new[_GN_MAX : _GN_MAX + 2] = torch.where(higher, torch.cat([x[1:], row[:1]]), state[_GN_MAX : _GN_MAX + 2])
        state.copy_(new)
        self._unread = True
        return ok

    def read(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, extra: dict[str, torch.Tensor] | None = None
    ) -> StepValues:
        """Log step: ``loss``, ``grad_norm`` and any other logged scalars (``extra``), globally reduced,
        and the device record in one host read. Reports non-finite steps (raises TitanError for
        ``stop`` or too many skips in a row), feeds the spike detectors and returns the values."""
        extra = extra or {}
        tensors = [v.detach().reshape(()).to(torch.float64) for v in (loss, grad_norm, *extra.values())]
        state = self._record(tensors[0].device)
        read = torch.cat([torch.stack(tensors), state]).tolist()  # the one host read of a log step
        out = StepValues(read[0], read[1], dict(zip(extra, read[2 : len(tensors)])))
        self._unread = False
        self._report(step, read[len(tensors) :])
        state[_GN_MAX].fill_(-math.inf)  # a new window (fills: no host-to-device copy)
        state[_GN_MAX_STEP].fill_(0)
        if math.isfinite(out.loss) and math.isfinite(out.grad_norm):
            self.loss.update(step, out.loss)
        gn_max, gn_step = read[len(tensors) + _GN_MAX], read[len(tensors) + _GN_MAX_STEP]
        if math.isfinite(gn_max):  # any finite step since the last log
            self.grad_norm.update(int(gn_step), gn_max)
        return out

    def resolve(self, step: int) -> None:
        """Read the device record alone and report (a save, validation or the end of training is next)."""
        if self._unread and self._state is not None:
            self._unread = False
            self._report(step, self._state.tolist())

    def _report(self, step: int, state: list[float]) -> None:
        def where(at: int) -> str:  # "loss = nan, grad_norm = nan at step 12"
            pairs = zip(("loss", "grad_norm"), state[at + 1 : at + 3])
            return (
                ", ".join(f"{name} = {v}" for name, v in pairs if not math.isfinite(v)) + f" at step {int(state[at])}"
            )

        def seen(at: int) -> str:  # a report later than the step itself says when it was read
            return "" if int(state[at]) == step else f" (found at step {step})"

        if self.policy == "stop" and state[_FIRST]:
            raise TitanError(
                f"non-finite {where(_FIRST)} (training.nonfinite = stop): stopping without saving;"
                " restart from the last checkpoint, maybe with a lower lr or skip_step" + seen(_FIRST)
            )
        if state[_LIMIT]:
            raise TitanError(
                f"non-finite {where(_LIMIT)}: {self.max_consecutive_skips + 1} consecutive steps skipped,"
                " more than training.nonfinite_max_consecutive_skips ="
                f" {self.max_consecutive_skips}" + seen(_LIMIT)
            )
        skipped = int(state[_SKIPPED])
        if skipped > self.skipped_steps:
            new = skipped - self.skipped_steps
            self.skipped_steps = skipped
            logger.warning(
                f"non-finite {where(_LAST)}: optimizer step skipped"
                + (f" (with {new - 1} earlier step(s) since the last report)" if new > 1 else "")
                + f" ({skipped} skipped so far, {int(state[_IN_A_ROW])} in a row)"
            )

    def scalars(self) -> dict[str, float]:
        return {
            **self.grad_norm.scalars("stability/grad_norm"),
            **self.loss.scalars("stability/loss"),
            "stability/skipped_steps": float(self.skipped_steps),
        }

    def console(self) -> dict[str, float]:
        """The counters worth a place on the console line, once any of them is non-zero."""
        if not (self.grad_norm.events or self.loss.events or self.skipped_steps):
            return {}
        return {
            "grad_spikes": float(self.grad_norm.events),
            "loss_spikes": float(self.loss.events),
            "skipped": float(self.skipped_steps),
        }


@torch.no_grad()
def param_norm(model_parts: list[torch.nn.Module], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Total L2 norm of all parameters: DTensor shards are combined (full_tensor of the norm), and
    with pipeline parallelism the per-stage norms are summed in square over ``pp_group``."""
    return global_l2_norm([p.detach() for m in model_parts for p in m.parameters()], pp_group)
