"""The pieces of in-memory snapshots without a process group: a state written to a slot and read
back exactly, a torn or damaged slot never read, and the restart's choice among the copies."""

import shutil
import uuid
from pathlib import Path

import pytest
import torch

from titan.checkpointing.snapshot_budget import NodeNeed, node_need, ring_offset
from titan.checkpointing.snapshot_state import capture, read, restore
from titan.checkpointing.snapshot_store import Held, SnapshotFolder, inventory, new_manifest, remove_if_empty
from titan.checkpointing.snapshot_transfer import plan
from titan.checkpointing.states import ModelParts, TrainState


@pytest.fixture
def root():
    path = Path("/dev/shm") / f"titan-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


class _Optimizers:  # the container's shape: a list of torch optimizers
    def __init__(self, optimizers):
        self.optimizers = optimizers


def _states(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    train = TrainState(step=7, tokens_seen=70)
    return {"model": ModelParts([model]), "optimizer": _Optimizers([opt]), "train_state": train}, model, opt


def _write(folder: SnapshotFolder, states, step: int):
    cap = capture(read(states, frozenset({"model", "optimizer"})))
    slot = folder.next_slot()
    slot.invalidate()
    cap.copy_into(slot.buffer(cap.nbytes))
    man = new_manifest(step, 0, cap.nbytes, slot.data_digest(), cap.meta, cap.layout, "cfg")
    slot.write_meta(cap.meta)
    slot.commit(man)
    return slot, man


def test_a_slot_holds_the_state_exactly_and_a_torn_or_damaged_one_is_never_read(root):
    states, model, opt = _states(0)
    folder = SnapshotFolder(str(root / "rank0"))
    slot, man = _write(folder, states, 7)
    other, _, other_opt = _states(1)  # another state of the same layout, restored into
    other["train_state"].step = 0
    data = slot.read_buffer(man.data_bytes)
    assert slot.data_digest() == man.data_xxh
    restore(other, slot.read_meta(man), data)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), other["model"].parts[0].state_dict().values())
    )
    exp = [s["exp_avg"] for s in opt.state.values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(exp, other_opt.state.values()))
    assert other["train_state"].step == 7 and other_opt.param_groups[0]["lr"] == 1e-2

    # the next snapshot goes to the other slot; a writer killed before its manifest leaves it torn
    nxt = folder.next_slot()
    assert nxt.index != slot.index
    nxt.invalidate()
    nxt.buffer(man.data_bytes)
    held, torn = inventory(str(root))
    assert [(h.rank, h.step) for h in held] == [(0, 7)] and torn == [0]
    # a flipped byte: the checksum no longer matches
    data = slot.buffer(man.data_bytes)
    data[3] ^= 0xFF
    assert slot.data_digest() != man.data_xxh


def _held(rank: int, step: int, own: bool = True, layout: str = "L") -> Held:
    return Held(rank, step, f"/x/{'rank' if own else 'copy-of-rank'}{rank}", 0, layout, "cfg", own)


def test_the_restart_takes_the_newest_step_every_rank_holds():
    # rank 1 lost step 6 (torn): both take 5; rank 0 reads its own, nothing moves
    chosen, _ = plan([[_held(0, 5), _held(0, 6)], [_held(1, 5)]], ["L", "L"], "cfg", disk_step=4)
    assert chosen is not None and chosen.step == 5 and {r: h for r, (h, _) in chosen.sources.items()} == {0: 0, 1: 1}
    # node 0 lost its memory: rank 1 keeps a copy of rank 0's step 6
    chosen, _ = plan([[], [_held(1, 6), _held(0, 6, own=False)]], ["L", "L"], "cfg", disk_step=4)
    assert chosen is not None and chosen.step == 6 and chosen.sources[0][0] == 1
    # nothing newer than the disk checkpoint, another layout, nothing at all: the disk
    assert plan([[_held(0, 4)], [_held(1, 4)]], ["L", "L"], "cfg", disk_step=8)[0] is None
    assert plan([[_held(0, 9, layout="M")], [_held(1, 9, layout="M")]], ["L", "L"], "cfg", disk_step=8)[0] is None
    chosen, why = plan([[_held(0, 9)], []], ["L", "L"], "cfg", disk_step=-1)
    assert chosen is None and "missing for rank(s) [1]" in why
    # a copy found damaged is passed over for an older step every rank holds
    held = [[_held(0, 5), _held(0, 6)], [_held(1, 5), _held(1, 6)]]
    chosen, _ = plan(held, ["L", "L"], "cfg", disk_step=-1, bad=frozenset({(1, 1, 6)}))
    assert chosen is not None and chosen.step == 5


def test_the_ring_peer_is_on_another_node_and_the_memory_counts_both_copies():
    assert ring_offset(["a", "a"]) == 0  # one node: no peer copies
    assert ring_offset(["0", "0", "1", "1"]) == 2  # rank r -> r + 2: the same place on the next node
    assert ring_offset(["0", "1", "0", "1"]) == 1
    need = node_need(["0", "0", "1", "1"], [10, 20, 30, 40], "0", 2)
    assert need == NodeNeed("0", 2, 20, 40, 2 * (10 + 20 + 30 + 40))


def test_the_last_rank_to_end_removes_the_job_folder_in_whatever_order_ranks_end(root):
    # Each rank removes its own folder, then the job folder if it is empty. A rank that ends after
    # another removed the job folder must not fail (the two-rank exact-resume test once did).
    for name in ("rank0", "rank1"):
        (root / name).mkdir(parents=True)
    shutil.rmtree(root / "rank0")
    remove_if_empty(str(root))
    assert (root / "rank1").is_dir()
    shutil.rmtree(root / "rank1")
    remove_if_empty(str(root))
    assert not root.exists()
    remove_if_empty(str(root))  # a rank that ends later still
