"""Reading a token store: dp ranks and workers disjoint and complete, exact resume, reshard, shuffle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from titan.data.token_store import (
    FORMAT,
    MANIFEST,
    VERSION,
    TokenStore,
    tokenizer_fingerprint,
    write_shard,
)
from titan.data.windows import StoreDataLoader, permute
from titan.errors import TitanError

SEQ = 7  # windows of 8 tokens


class Tok:
    vocab_size, bos_id, eos_id, path = 70_000, 0, 1, ""  # > 2**16: uint32 shards


def numbered_store(folder: Path, docs_per_shard=(5, 0, 7, 3), doc_len=9) -> TokenStore:
    """Token t of the concatenation has id t + 2 (never a special id): a window names its index."""
    folder.mkdir(exist_ok=True)
    entries, t = [], 2
    for i, n in enumerate(docs_per_shard):
        docs = [list(range(t + d * doc_len, t + (d + 1) * doc_len)) for d in range(n)]
        t += n * doc_len
        entries.append(write_shard(folder, f"{i:05d}", docs, np.dtype(np.uint32), 0))
    (folder / MANIFEST).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "tokenizer": tokenizer_fingerprint(Tok()),
                "bos": True,
                "eos": True,
                "dtype": "uint32",
                "shards": entries,
            }
        )
    )
    return TokenStore(str(folder))


@pytest.fixture
def store(tmp_path):
    return numbered_store(tmp_path / "s")


def make(store, world=1, rank=0, workers=0, infinite=True, batch=2, seed=None, seq=SEQ):
    return StoreDataLoader(
        store,
        Tok(),
        seq_len=seq,
        local_batch_size=batch,
        dp_rank=rank,
        dp_world_size=world,
        num_workers=workers,
        infinite=infinite,
        shuffle_seed=seed,
    )


def window_ids(batch) -> list[int]:
    """Window index of every row: the first input token is 2 + index * (SEQ + 1)."""
    inputs, labels = batch
    assert (labels[:, :-1] == inputs[:, 1:]).all()
    return [(int(row[0]) - 2) // (SEQ + 1) for row in inputs]


def test_windows_are_consecutive_token_runs(store):
    n = store.num_windows(SEQ)
    assert n == store.num_tokens // (SEQ + 1) == (15 * 9) // 8
    got = [w for b in make(store, batch=1, infinite=False) for w in window_ids(b)]
    assert got == list(range(n))


SLOW = pytest.mark.slow  # worker processes


@pytest.mark.parametrize(
    "world, workers", [(1, 0), (2, 0), pytest.param(1, 2, marks=SLOW), pytest.param(2, 2, marks=SLOW)]
)
def test_ranks_and_workers_disjoint_and_complete(store, world, workers):
    seen = []
    for rank in range(world):
        seen += [w for b in make(store, world, rank, workers, infinite=False, batch=1) for w in window_ids(b)]
    assert sorted(seen) == list(range(store.num_windows(SEQ)))


def take(loader, n):
    it = iter(loader)
    return [window_ids(next(it)) for _ in range(n)]


@pytest.mark.parametrize(
    "workers, seed", [(0, None), pytest.param(2, None, marks=SLOW), (0, 5), pytest.param(2, 5, marks=SLOW)]
)
@pytest.mark.parametrize("k", [1, 4, 11])
def test_exact_resume(store, workers, seed, k):
    for world in (1, 2):
        for rank in range(world):
            reference = take(make(store, world, rank, workers, seed=seed), k + 6)
            first = make(store, world, rank, workers, seed=seed)
            assert take(first, k) == reference[:k]
            resumed = make(store, world, rank, workers, seed=seed)
            resumed.load_state_dict(first.state_dict())
            assert take(resumed, 6) == reference[k:]


@pytest.mark.parametrize("old, new, seed", [(2, 1, None), (1, 2, None), (2, 1, 3), (1, 2, 3), (2, 3, None)])
def test_reshard_repeats_and_skips_nothing(store, old, new, seed):
    n = store.num_windows(SEQ)
    seen, states = [], []
    for rank in range(old):
        loader = make(store, old, rank, infinite=False, batch=1, seed=seed)
        seen += [w for ids in take(loader, 2 + rank) for w in ids]
        states.append(loader.state_dict())
    for rank in range(new):
        loader = make(store, new, rank, infinite=False, batch=1, seed=seed)
        loader.load_resharded(states)
        seen += [w for b in loader for w in window_ids(b)]
    assert sorted(seen) == list(range(n))


@SLOW
def test_worker_count_change_is_exact(store):
    first = make(store, workers=2, batch=1, infinite=False)
    seen = [w for ids in take(first, 3) for w in ids]
    resumed = make(store, workers=0, batch=1, infinite=False)
    resumed.load_state_dict(first.state_dict())
    seen += [w for b in resumed for w in window_ids(b)]
    assert sorted(seen) == list(range(store.num_windows(SEQ)))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 100, 1000, 4097])
def test_permute_is_a_bijection(n):
    for seed, epoch in ((0, 0), (1, 0), (1, 1)):
        assert sorted(permute(i, n, seed, epoch) for i in range(n)) == list(range(n))


def test_shuffle_is_seeded_per_epoch_and_covers_every_window(store):
    n = store.num_windows(SEQ)
    two_epochs = [w for ids in take(make(store, batch=1, seed=7), 2 * n) for w in ids]
    assert sorted(two_epochs[:n]) == sorted(two_epochs[n:]) == list(range(n))
    assert two_epochs[:n] != list(range(n)) and two_epochs[:n] != two_epochs[n:]
    assert [w for ids in take(make(store, batch=1, seed=7), n) for w in ids] == two_epochs[:n]
    assert [w for ids in take(make(store, batch=1, seed=8), n) for w in ids] != two_epochs[:n]


def test_changed_seq_len_is_refused(store):
    first = make(store)
    take(first, 1)
    with pytest.raises(TitanError, match="windows per epoch") as e:
        make(store, seq=5).load_state_dict(first.state_dict())
    assert "\n" not in str(e.value)


def test_state_of_a_text_dataset_restarts_the_store(store, caplog):
    from titan.data.datasets import ListSource
    from titan.data.loader import TitanDataLoader

    class Bytes(Tok):
        def encode(self, text, *, bos, eos):
            return [0] + list(text.encode()) + [1]

    text = TitanDataLoader(
        ListSource("docs", ["abc"] * 5), Bytes(), seq_len=SEQ, local_batch_size=1, dp_rank=0, dp_world_size=1
    )
    loader = make(store, batch=1)
    loader.load_state_dict(text.state_dict())  # another dataset: warned, started from the beginning
    assert take(loader, 1) == [[0]]


def test_state_of_a_mixture_restarts_a_single_source(store, tmp_path):
    from titan.config.sections.training import MixtureSource
    from titan.data import build_dataloader

    mixture = build_dataloader(
        dataset="",
        dataset_path="",
        text_field="text",
        tokenizer=Tok(),
        seq_len=SEQ,
        local_batch_size=1,
        dp_rank=0,
        dp_world_size=1,
        mixture=[MixtureSource(path=store.path), MixtureSource(path=store.path)],
    )
    loader = make(store, batch=1)
    loader.load_state_dict(mixture.state_dict())  # another kind of state: warned, started from the beginning
    assert take(loader, 1) == [[0]]
