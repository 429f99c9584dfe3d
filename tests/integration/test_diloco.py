"""DiLoCo across replica groups (fault_tolerance.semi_sync_method = "diloco"), against a real
torchft lighthouse on localhost.

- Two groups in one process (threads), each a real titan ReplicaGroups on a small Llama with
  titan's AdamW container, end on the weights of the same outer steps written out by hand on
  plain torch: pseudo-gradient averaged over the groups, Nesterov SGD (lr 0.7, momentum 0.9) per
  fragment, fragments in torchft's order, the delayed sync and the local/global mix.
- The outer state (momentum, last global weights, inner steps since, torchft's step) is in each
  group's checkpoints: two train.py groups resumed from their step-3 checkpoints end on step 6
  bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import copy
import glob
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.replica_groups import flat, group, output
from tests.helpers.replica_groups import lighthouse as start_lighthouse

pytest.importorskip("torchft")

from titan.checkpointing.states import ModelParts, TrainState  # noqa: E402
from titan.config.sections.fault_tolerance import FaultTolerance  # noqa: E402
from titan.config.sections.optimizer import Optimizer as OptimizerConfig  # noqa: E402
from titan.ft.preflight import LIGHTHOUSE_ENV  # noqa: E402
from titan.ft.replicas import ReplicaGroups  # noqa: E402
from titan.models.llama import Transformer, TransformerModelArgs  # noqa: E402
from titan.training.optim import build_optimizers  # noqa: E402

GROUPS = 2
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # torchtitan v0.2.2's outer optimizer
VOCAB, SEQ = 64, 8
INNER = OptimizerConfig(lr=1e-2, weight_decay=0.1, implementation="for-loop")
# Fragment k of the split into two: the embeddings + layer 0, then layer 1 + norm + output
# (titan's split by layers, the ends counted as one layer each).
HALVES = (("tok_embeddings.", "layers.0."), ("layers.1.", "norm.", "output."))


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """A lighthouse that waits for both groups before any quorum: every synchronization averages
    over the two, never over whichever group asked first."""
    with start_lighthouse(GROUPS, "--join_timeout_ms", "20000", "--quorum_tick_ms", "20") as url:
        yield url


def tiny_llama() -> Transformer:
    torch.manual_seed(0)
    args = TransformerModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=16, max_seq_len=SEQ
    )
    model = Transformer(args)
    model.init_weights()
    return model


def group_batches(group: int, steps: int) -> list[torch.Tensor]:
    """The group's own token windows, one per inner step (inputs = [:, :-1], labels = [:, 1:])."""
    g = torch.Generator().manual_seed(100 + group)
    return [torch.randint(0, VOCAB, (2, SEQ + 1), generator=g) for _ in range(steps)]


def loss_of(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    logits = model(window[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())


@dataclass
class Case:
    steps: int
    sync_steps: int
    num_fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0


CASES = {
    # Three outer steps of the whole model: the second and third carry momentum.
    "whole_model": Case(steps=6, sync_steps=2),
    # Two fragments in turn, one every 2 inner steps: each steps twice (momentum on the second).
    "two_fragments": Case(steps=8, sync_steps=4, num_fragments=2),
    # Streaming DiLoCo's delay (pseudo-gradients taken one inner step before the sync) and the
    # mix of local and global weights after it (the groups then differ until the next sync).
    "delay_and_mix": Case(steps=8, sync_steps=4, num_fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.25),
}


def titan_group(replica: int, case: Case, init: Transformer) -> dict[str, torch.Tensor]:
    """One replica group as the trainer wires it (the checkpoint states handed to ReplicaGroups,
    the hooks on the inner optimizer), trained on its own batches; its final weights."""
    model = copy.deepcopy(init)
    optimizers = build_optimizers([model], INNER)
    train_state = TrainState()
    states = {"model": ModelParts([model]), "optimizer": optimizers, "train_state": train_state}
    cfg = FaultTolerance(
        enable=True,
        replica_id=replica,
        group_size=GROUPS,
        min_replica_size=GROUPS,
        semi_sync_method="diloco",
        sync_steps=case.sync_steps,
        num_fragments=case.num_fragments,
        fragment_sync_delay=case.fragment_sync_delay,
        fragment_update_alpha=case.fragment_update_alpha,
    )
    cfg.validate()
    replicas = ReplicaGroups(cfg, states, {}, torch.device("cpu"))
    params = list(model.parameters())
    try:
        for window in group_batches(replica, case.steps):
            optimizers.zero_grad()
            replicas.start_step()
            loss_of(model, window).backward()
            assert replicas.sync_gradients(params)
            optimizers.step()  # DiLoCo's hook synchronizes here when a fragment is due
            train_state.step += 1
        assert replicas.manager.current_step() == case.steps * case.num_fragments // case.sync_steps
    finally:
        replicas.close()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def by_hand(case: Case, init: Transformer, momentum: float = OUTER_MOMENTUM) -> list[dict[str, torch.Tensor]]:
    """The same run on one thread: both groups' inner AdamW steps on plain torch, and at each
    synchronization the outer step written out. Returns each group's final weights."""
    models = [copy.deepcopy(init) for _ in range(GROUPS)]
    betas = (INNER.beta1, INNER.beta2)
    kwargs = {"lr": INNER.lr, "betas": betas, "eps": INNER.eps, "weight_decay": INNER.weight_decay}
    inner = [torch.optim.AdamW(m.parameters(), foreach=False, **kwargs) for m in models]
    batches = [group_batches(g, case.steps) for g in range(GROUPS)]
    names = [n for n, _ in init.named_parameters()]
    if case.num_fragments == 1:
        fragments = [names]
    else:
        fragments = [[n for n in names if n.startswith(prefixes)] for prefixes in HALVES]
    glob_w = {n: p.detach().clone() for n, p in init.named_parameters()}  # the last synchronized weights
    buf: dict[str, torch.Tensor] = {}  # one momentum buffer per parameter: per fragment's optimizer
    every = case.sync_steps // case.num_fragments  # a fragment synchronizes every `every` inner steps
    outer_steps, since = 0, 0
    pseudo: dict[str, torch.Tensor] = {}
    for step in range(case.steps):
        for m, opt, windows in zip(models, inner, batches):
            opt.zero_grad()
            loss_of(m, windows[step]).backward()
            opt.step()
        since += 1
        # torchft picks the fragment by its count of committed synchronizations.
        frag = fragments[outer_steps % case.num_fragments]
        if since == every - case.fragment_sync_delay:
            weights = [dict(m.named_parameters()) for m in models]
            pseudo = {
                n: sum((glob_w[n] - w[n].detach() for w in weights), torch.zeros_like(glob_w[n])) / GROUPS for n in frag
            }
        if since < every:
            continue
        # Each a·x + y below is one add(x, alpha=a), rounded once as torch's SGD rounds it: the
        # groups' weights then match bit for bit.
        with torch.no_grad():
            for n in frag:
                g = pseudo[n]  # the mean over the groups of (last global - local)
                buf[n] = g.clone() if n not in buf else buf[n].mul(momentum).add(g)  # μ·buf + g
                update = g.add(buf[n], alpha=momentum)  # Nesterov: g + μ·buf
                glob_w[n] = glob_w[n].add(update, alpha=-OUTER_LR)  # θ - lr·update: the new global
                for m in models:  # each group: global + alpha·(its local - global)
                    p = m.get_parameter(n)
                    p.copy_(glob_w[n].add(p - glob_w[n], alpha=case.fragment_update_alpha))
        outer_steps, since = outer_steps + 1, 0
    return [{n: p.detach().clone() for n, p in m.named_parameters()} for m in models]


@pytest.mark.parametrize("name", list(CASES))
def test_diloco_groups_match_outer_steps_by_hand(name: str, lighthouse: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    monkeypatch.setenv(LIGHTHOUSE_ENV, lighthouse)
    init = tiny_llama()
    with ThreadPoolExecutor(max_workers=GROUPS) as pool:
        runs = [pool.submit(titan_group, g, case, init) for g in range(GROUPS)]
        got = [run.result(timeout=120) for run in runs]
    want = by_hand(case, init)
    for g in range(GROUPS):
        assert got[g].keys() == want[g].keys()
        for key, value in got[g].items():
            torch.testing.assert_close(value, want[g][key], rtol=0, atol=0, msg=f"group {g}: {key}")
    # The outer momentum moves the result far beyond rounding: a run that dropped it would fail.
    no_momentum = by_hand(case, init, momentum=0.0)
    assert any(not torch.allclose(got[0][k], v, rtol=1e-4, atol=1e-5) for k, v in no_momentum[0].items())


def saved_step(dump: Path, step: int) -> dict[str, object]:
    """A group's checkpoint of ``step``, flattened: the DCP contents (model, optimizer, LR
    schedule, train state, torchft's step under fault_tolerance.*) and its per-rank file (RNG,
    data loader and the DiLoCo state under semi_sync.*: outer momentum, last global weights,
    inner steps since the last sync)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = dump / "checkpoint" / f"step-{step}"
    dcp_to_torch_save(str(folder), str(dump / f"step-{step}.pt"))
    saved = torch.load(dump / f"step-{step}.pt", weights_only=False)
    (rank_file,) = glob.glob(str(folder / "rank_*.pt"))
    saved["rank"] = torch.load(rank_file, weights_only=False)
    return flat(as_dicts(saved))


def as_dicts(tree: object) -> object:
    """Lists (one entry per fragment, per param group) as dicts by position, for flat()."""
    if isinstance(tree, dict):
        return {k: as_dicts(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return {i: as_dicts(v) for i, v in enumerate(tree)}
    return tree


def test_diloco_state_resumes_exactly_from_checkpoints(lighthouse: str, tmp_path: Path) -> None:
    """Run A: two groups, 6 steps, checkpoints at 3 and 6. Run B: each group resumed from its
    step-3 checkpoint to step 6. Syncs fall on steps 2, 4 and 6: the sync of step 2 gives each
    outer optimizer its momentum, which only the checkpoint carries into run B, where the syncs of
    steps 4 and 6 step with it (and with the global weights of step 2, and the inner-step count
    that puts the next sync on step 4); a resume without any of these ends on other weights."""
    diloco = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "2"]
    run = [*diloco, "--fault_tolerance.min_replica_size", "2", "--training.steps", "6", "--checkpoint.interval", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()

    def both(folder: Path) -> None:
        procs = [group(lighthouse, folder, r, *run, env={}) for r in range(GROUPS)]
        for r, proc in enumerate(procs):
            out = output(proc, folder, r, timeout=120)
            assert proc.returncode == 0, out[-3000:]

    both(a)
    for r in range(GROUPS):
        shutil.copytree(a / f"r{r}/checkpoint/step-3", b / f"r{r}/checkpoint/step-3")
    both(b)
    for r in range(GROUPS):
        assert f"r{r}/checkpoint/step-3: step 3" in (b / f"group{r}.log").read_text()  # resumed, not started
        want, got = saved_step(a / f"r{r}", 6), saved_step(b / f"r{r}", 6)
        assert want.keys() == got.keys()
        assert any(k.startswith("rank.semi_sync.outer.0.state.") for k in want)  # the momentum buffers
        assert any(k.startswith("optimizer.state.") for k in want)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                other = got[key]
                assert isinstance(other, torch.Tensor) and torch.equal(value, other), f"group {r}: {key}"
            else:
                assert value == got[key], f"group {r}: {key}"
