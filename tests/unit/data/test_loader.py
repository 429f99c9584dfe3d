"""Packing, DP sharding, exact resume (0 and 2 workers) and exact resharding of the loader."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest
import torch

from tests.helpers.doc_loader import DOC_SOURCE, DocTokenizer, make, take
from titan.data.datasets import ListSource
from titan.data.loader import TitanDataLoader, build_dataloader
from titan.data.packing import reshard_states, unread_entries
from titan.data.state import Cursor, Segment, StreamState


class ByteTokenizer:
    """ids = utf-8 bytes; 256 = BOS, 257 = EOS."""

    vocab_size, bos_id, eos_id = 258, 256, 257

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return [self.bos_id] * bos + list(text.encode()) + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


ALL_TOKENS = Counter(t for d in DOC_SOURCE.docs for t in DocTokenizer().encode(d, bos=True, eos=True))


def leftover(state, doc_of=lambda unit, row: DOC_SOURCE.get(unit)) -> Counter:
    """Tokens a (finished) rank still holds: its packing buffer; asserts nothing is left unread.
    ``doc_of(unit, row)``: the text of row ``row`` of unit ``unit`` (one document per unit by default)."""
    c = Counter()
    for st in state["streams"]:
        n = st["num_units"]
        assert not st["pending"] and st["next"] >= n and (st["cur"] is None or st["cur"][0] >= n)
        for pos, row, off in st["segments"]:
            c.update(DocTokenizer().encode(doc_of(pos % n, row), bos=True, eos=True)[off:])
    return c


def tokens(batches) -> Counter:
    c = Counter()
    for x, y in batches:  # windows are x plus the last label column
        c.update(torch.cat([x, y[:, -1:]], dim=1).flatten().tolist())
    return c


def test_packing_windows_bos_eos_and_shift():
    tok = ByteTokenizer()
    src = ListSource("bytes", ["hello world", "ab", "a much longer document that spans several windows"])
    loader = TitanDataLoader(src, tok, seq_len=8, local_batch_size=3, dp_rank=0, dp_world_size=1, infinite=False)
    batches = list(loader)
    expected = [t for d in src.docs for t in tok.encode(d, bos=True, eos=True)]
    assert len(batches) == len(expected) // (3 * 9)
    stream = []
    for x, y in batches:
        assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one
        stream += torch.cat([x, y[:, -1:]], dim=1).flatten().tolist()  # seq_len + 1 windows
    assert stream == expected[: len(stream)]
    assert stream[0] == tok.bos_id and stream[12] == tok.eos_id and stream[13] == tok.bos_id


def test_build_dataloader_jsonl(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": f"doc {i} " * 5}) + "\n" for i in range(20)))
    loader = build_dataloader(
        dataset="local",
        dataset_path=str(f),
        text_field="text",
        tokenizer=ByteTokenizer(),
        seq_len=16,
        local_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
        infinite=False,
    )
    n_tokens = sum(len(f"doc {i} " * 5) + 2 for i in range(20))
    assert len(list(loader)) == n_tokens // (2 * 17)


def test_two_ranks_disjoint_and_complete():
    seen = []
    for rank in range(2):
        loader = make(world=2, rank=rank, infinite=False)
        got = tokens(list(loader))
        seen.append(Counter({t: n for t, n in (got + leftover(loader.state_dict())).items() if t > 1}))
    assert not set(seen[0]) & set(seen[1])
    assert seen[0] + seen[1] == Counter({t: n for t, n in ALL_TOKENS.items() if t > 1})


def _check_resume(world, workers, k=3, n=20):
    for rank in range(world):
        reference = take(make(world, rank, workers), k + n)
        first = make(world, rank, workers)
        take(first, k)
        state = first.state_dict()
        resumed = make(world, rank, workers)
        resumed.load_state_dict(state)
        for (x, y), (rx, ry) in zip(reference[k:], take(resumed, n)):
            assert torch.equal(x, rx) and torch.equal(y, ry)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_exact(world):
    _check_resume(world, workers=0)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_exact_with_workers(world):
    _check_resume(world=world, workers=2)


def _check_reshard(old_world, new_world, k, old_workers=0, new_workers=0):
    """Run old ranks k batches, save, load into new_world ranks, run to the end (finite): every
    token of the dataset is emitted or left in a final buffer exactly once."""
    total, states = Counter(), []
    for rank in range(old_world):
        loader = make(old_world, rank, old_workers, infinite=False)
        total += tokens(take(loader, k))
        states.append(loader.state_dict())
    for rank in range(new_world):
        loader = make(new_world, rank, new_workers, infinite=False)
        loader.load_resharded(states)
        total += tokens(list(loader)) + leftover(loader.state_dict())
    assert total == ALL_TOKENS


@pytest.mark.parametrize("old, new", [(2, 1), (1, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("k", [1, 4])
def test_reshard_exact(old, new, k):
    _check_reshard(old, new, k)


def test_same_world_reshard_is_plain_resume():
    states = []
    for rank in range(2):
        loader = make(2, rank)
        take(loader, 3)
        states.append(loader.state_dict())
    a, b = make(2, 1), make(2, 1)
    a.load_resharded(states)
    b.load_state_dict(states[1])
    assert all(torch.equal(x[0], y[0]) for x, y in zip(take(a, 5), take(b, 5)))


def test_worker_count_change_is_exact():
    _check_reshard(1, 1, k=3, old_workers=0, new_workers=2)  # load_state_dict re-deals the rank's docs
    _check_reshard(2, 1, k=2, old_workers=2, new_workers=0)


def test_reshard_states_across_epochs_covers_every_position_once():
    # old streams caught mid-way at different epochs (positions p = epoch * N + index)
    # (a partly read unit is continued from its row)
    old = [
        StreamState(
            slot=0, stride=2, next=40, cur=Cursor(38, 3), segments=[Segment(38, 2, 1)], epoch=1, num_units=37, docs=5
        ),
        StreamState(slot=1, stride=2, next=33, pending=[Cursor(29, 0)], docs=4),
    ]
    new = reshard_states(old, [0, 1, 2], 3)
    bound = 200

    def where(c: Cursor) -> tuple[int, int]:
        return c.position, c.row

    before = sorted(where(e) for s in old for e in unread_entries(s, bound))
    after = sorted(where(e) for s in new for e in unread_entries(s, bound))
    assert before == after and len(set(after)) == len(after) and (38, 3) in after
    assert [s.num_units for s in new] == [37] * 3 and new[0].segments == [Segment(38, 2, 1)]
    assert sum(s.docs for s in new) == 9


def test_finite_mode_stops():
    loader = make(infinite=False, seq_len=7, batch=2)
    assert len(list(loader)) == sum(ALL_TOKENS.values()) // 16
    assert list(loader) == []  # exhausted state stays exhausted


def test_infinite_mode_reloops_with_epoch_counter(caplog):
    loader = make(seq_len=7, batch=2)
    n = sum(ALL_TOKENS.values()) // 16 + 2
    with caplog.at_level(logging.INFO, logger="titan"):
        take(loader, n)
    assert loader.state_dict()["streams"][0]["epoch"] == 1
    assert any("epoch 1" in r.getMessage() for r in caplog.records)


def test_infinite_single_doc_two_ranks():
    # fewer documents than ranks: ranks alternate over the epochs instead of starving
    src = ListSource("one", ["0:5"])
    a, b = (take(make(2, r, source=src, seq_len=3, batch=1), 3) for r in range(2))
    assert a[0][0].tolist() == [[0, 1000, 1001]] and b[0][0].tolist() == a[0][0].tolist()


def test_play_txt_two_ranks(tmp_path):
    from tests.fixtures import write_play

    kw = dict(
        dataset="x",
        dataset_path=str(write_play(tmp_path / "play.txt")),
        text_field="text",
        tokenizer=ByteTokenizer(),
        seq_len=64,
        local_batch_size=2,
        dp_world_size=2,
    )
    x0, _ = take(build_dataloader(dp_rank=0, **kw), 1)[0]
    x1, _ = take(build_dataloader(dp_rank=1, **kw), 1)[0]
    assert ByteTokenizer().decode(x0[0].tolist()).startswith("First Citizen:")
    assert not torch.equal(x0, x1)


def test_streamed_files_with_workers_exact(tmp_path):
    # `datasets` streams split their files among DataLoader workers unless told otherwise; the
    # document numbering (hence sharding and resume) must not depend on the worker count
    for part in range(2):
        (tmp_path / f"part{part}.jsonl").write_text(
            "".join(json.dumps({"text": d}) + "\n" for d in DOC_SOURCE.docs[part * 20 : (part + 1) * 20])
        )
    kw = dict(
        dataset="local",
        dataset_path=str(tmp_path),
        text_field="text",
        tokenizer=DocTokenizer(),
        seq_len=7,
        local_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
    )
    reference = take(build_dataloader(num_workers=2, **kw), 12)
    first = build_dataloader(num_workers=2, **kw)
    take(first, 5)
    resumed = build_dataloader(num_workers=2, **kw)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(a[0], b[0]) for a, b in zip(reference[5:], take(resumed, 7)))
    finite = build_dataloader(num_workers=2, infinite=False, **kw)
    state = finite.state_dict()
    assert state["layout"] == "shards"  # two files, two workers: one file each
    assert (
        tokens(list(finite)) + leftover(finite.state_dict(), lambda f, row: DOC_SOURCE.docs[f * 20 + row]) == ALL_TOKENS
    )


def test_pydoc_with_shipped_vocab():
    from titan.data import build_tokenizer

    tok = build_tokenizer("")
    loader = build_dataloader(
        dataset="pydoc",
        dataset_path="",
        text_field="text",
        tokenizer=tok,
        seq_len=32,
        local_batch_size=2,
        dp_rank=0,
        dp_world_size=1,
    )
    x, y = take(loader, 1)[0]
    assert x[0, 0] == tok.bos_id and int(x.max()) < tok.vocab_size
    assert tok.decode(x[0, 1:].tolist()).strip()
