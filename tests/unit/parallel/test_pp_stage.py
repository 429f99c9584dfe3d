"""titan's pipeline stage keeps torch's shape inference out of the model parts' buffers.

torch 2.13's PipelineStage, given no example inputs/outputs, runs every stage once more before the
real micro-batches of the schedule's first ``step`` and again after each switch from ``eval`` (and
back): the first stage on a copy of micro-batch 0, a later stage on uninitialised tensors, in the
module's mode, with grad enabled under ``step``. Two stages on one rank (a looped schedule in a
one-process group) show both kinds of stage without spawning ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleGPipe, ScheduleLoopedBFS

from tests.helpers.distributed import one_rank_group
from titan.parallel.pp import buffers_kept, make_stages

MICRO = 2
DIM = 4


class Probe(nn.Module):
    """Counts its forwards in a buffer, as the MoE layers count routed tokens, keeps a running
    maximum it replaces each forward, and notes each forward's mode and grad state."""

    calls: torch.Tensor
    peak: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("peak", torch.zeros(()))
        self.seen: list[tuple[bool, bool, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls.add_(1)
            self.peak = torch.maximum(self.peak, x.detach().abs().amax().nan_to_num())  # a new tensor
        self.seen.append((self.training, torch.is_grad_enabled(), x.detach().clone()))
        return self.lin(x)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    one_rank_group(str(tmp_path_factory.mktemp("pg") / "store"))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _inputs() -> torch.Tensor:
    return torch.randn(MICRO, DIM, generator=torch.Generator().manual_seed(0))


def _run(stages: list, parts: list[Probe], calls: tuple[str, ...]) -> list[list[int]]:
    """The schedule's ``calls`` (step / eval) in turn; every part's forward count after each. Two
    stages on one rank run a looped schedule: torch's runtime cannot ``eval`` adjacent stages on
    one rank (it runs their backward actions), so those only ``step``."""
    loss = lambda out, y: out.sum()  # noqa: E731
    schedule = (
        ScheduleLoopedBFS(stages, n_microbatches=MICRO, loss_fn=loss)
        if len(stages) > 1
        else ScheduleGPipe(stages[0], n_microbatches=MICRO, loss_fn=loss)
    )
    counts = []
    for call in calls:
        for m in parts:
            m.train(call == "step")
        if call == "step":
            schedule.step(_inputs(), target=torch.zeros(MICRO))
        else:
            with torch.no_grad():
                schedule.eval(_inputs(), target=torch.zeros(MICRO))
        counts.append([int(m.calls) for m in parts])
    return counts


def _torch_stages(parts: list[Probe], group) -> list:
    return [PipelineStage(m, i, len(parts), torch.device("cpu"), group=group) for i, m in enumerate(parts)]


def test_torch_stage_runs_each_stage_once_more_in_the_first_step_and_at_each_switch(group) -> None:
    """What titan's stage answers: torch's own counts the inference forwards too."""
    parts = [Probe(), Probe()]
    assert _run(_torch_stages(parts, group), parts, ("step", "step")) == [[3, 3], [5, 5]]  # MICRO + 1, then MICRO
    first, later = (m.seen for m in parts)
    # The extra forward comes first, in training mode with grad enabled; the first stage's is on micro-batch 0.
    assert first[0][:2] == later[0][:2] == (True, True)
    torch.testing.assert_close(first[0][2], _inputs()[:1])
    one = Probe()
    assert _run(_torch_stages([one], group), [one], ("step", "eval", "step")) == [[3], [6], [9]]
    assert [s[:2] for s in one.seen[::3]] == [(True, True), (False, False), (True, True)]


def test_titan_stage_leaves_the_buffers_as_the_real_micro_batches_do(group) -> None:
    parts = [Probe(), Probe()]
    assert _run(make_stages(parts, [0, 1], 2, torch.device("cpu"), group), parts, ("step", "step")) == [[2, 2], [4, 4]]
    # A buffer the forward replaces: the real inputs' maximum (the later stage's: the first stage's outputs).
    assert parts[0].peak == _inputs().abs().max()
    with torch.no_grad():
        torch.testing.assert_close(parts[1].peak, parts[0].lin(_inputs()).abs().max())
    one = Probe()
    assert _run(make_stages([one], [0], 1, torch.device("cpu"), group), [one], ("step", "eval", "step")) == [
        [2],
        [4],
        [6],
    ]


class Scaled(nn.Module):
    """Multiplies by a buffer (autograd saves it for the input's gradient) and counts its calls."""

    calls: torch.Tensor
    table: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.full((DIM,), 2.0))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls.add_(1)
        return x * self.table


def test_buffers_kept_writes_back_only_what_the_block_changed() -> None:
    m = Scaled()
    x = torch.ones(DIM, requires_grad=True)
    with buffers_kept(m):
        out = m(x)
        assert m.calls == 1
    assert m.calls == 0
    out.sum().backward()  # the table was left alone, not rewritten: the graph that saved it still runs
    torch.testing.assert_close(x.grad, torch.full((DIM,), 2.0))
