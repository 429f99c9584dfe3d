"""Loader states written before the loader state became typed still resume exactly.

tests/fixtures/loader_states_v2.json was written by the previous loader (state version 2, plain
nested lists): for each case it holds the states it saved and the batches the previous loader
produced after restoring them. The loaders here rebuild the same data, restore those states (per
rank, through ``load_rank_states`` as the checkpoint manager does) and must produce the same batches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.saved_states import SavedStates
from titan.data.loader import TitanDataLoader
from titan.data.mixture import MixtureLoader
from titan.data.sources import DocumentSource
from titan.data.token_store import FORMAT, MANIFEST, VERSION, TokenStore, tokenizer_fingerprint, write_shard
from titan.data.windows import StoreDataLoader

FIXTURE = Path(__file__).parents[2] / "fixtures" / "loader_states_v2.json"
SEQ, BATCH = 7, 2


class DocTokenizer:
    """Doc "i:n" -> BOS, n tokens 1000*(i+1) + j, EOS."""

    vocab_size, bos_id, eos_id, path = 60_000, 0, 1, ""

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        i, n = map(int, text.split(":"))
        return [self.bos_id] * bos + [1000 * (i + 1) + j for j in range(n)] + [self.eos_id] * eos


class ShardedDocs(DocumentSource):
    """In-memory documents split into shards of ``per_shard`` documents."""

    seekable = True

    def __init__(self, name: str, docs: list[str], per_shard: int) -> None:
        self.name, self.docs, self.per_shard = name, docs, per_shard

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    @property
    def num_shards(self) -> int:
        return -(-len(self.docs) // self.per_shard)

    def get(self, index: int) -> str:
        return self.docs[index]

    def iter_docs(self, start: int = 0) -> Iterator[str]:
        return iter(self.docs[start:])

    def iter_shard(self, shard: int, row: int = 0) -> Iterator[str]:
        return iter(self.docs[shard * self.per_shard : (shard + 1) * self.per_shard][row:])


def docs(n: int) -> list[str]:
    return [f"{i}:{(i * 7) % 23 + 1}" for i in range(n)]


def token_store(folder: Path) -> TokenStore:
    folder.mkdir(exist_ok=True)
    entries, t = [], 2
    for i, n in enumerate((5, 0, 7, 3)):
        rows = [list(range(t + d * 9, t + (d + 1) * 9)) for d in range(n)]
        t += n * 9
        entries.append(write_shard(folder, f"{i:05d}", rows, np.dtype(np.uint32), 0))
    (folder / MANIFEST).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "tokenizer": tokenizer_fingerprint(DocTokenizer()),
                "bos": True,
                "eos": True,
                "dtype": "uint32",
                "shards": entries,
            }
        )
    )
    return TokenStore(str(folder))


def _docs_loader(source: ShardedDocs, world: int, rank: int, workers: int) -> TitanDataLoader:
    return TitanDataLoader(
        source,
        DocTokenizer(),
        seq_len=SEQ,
        local_batch_size=BATCH,
        dp_rank=rank,
        dp_world_size=world,
        num_workers=workers,
    )


def documents_loader(tmp: Path, world: int, rank: int, workers: int) -> TitanDataLoader:
    return _docs_loader(ShardedDocs("docs", docs(37), 37), world, rank, workers)


def shards_loader(tmp: Path, world: int, rank: int, workers: int) -> TitanDataLoader:
    return _docs_loader(ShardedDocs("sharded", docs(40), 5), world, rank, workers)


def store_loader(tmp: Path, world: int, rank: int, workers: int) -> StoreDataLoader:
    return StoreDataLoader(
        token_store(tmp / "store"),
        DocTokenizer(),
        seq_len=SEQ,
        local_batch_size=BATCH,
        dp_rank=rank,
        dp_world_size=world,
        num_workers=workers,
        shuffle_seed=3,
    )


def mixture_loader(tmp: Path, world: int, rank: int, workers: int) -> MixtureLoader:
    parts = [
        StoreDataLoader(
            token_store(tmp / "store"),
            DocTokenizer(),
            seq_len=SEQ,
            local_batch_size=1,
            dp_rank=rank,
            dp_world_size=world,
            num_workers=workers,
        ),
        TitanDataLoader(
            ShardedDocs("docs", docs(37), 37),
            DocTokenizer(),
            seq_len=SEQ,
            local_batch_size=1,
            dp_rank=rank,
            dp_world_size=world,
            num_workers=workers,
        ),
    ]
    return MixtureLoader(
        ["store", "docs"], parts, [0.6, 0.4], local_batch_size=BATCH, seq_len=SEQ, dp_rank=rank, dp_world_size=world
    )


BUILDERS = {"documents": documents_loader, "shards": shards_loader, "store": store_loader, "mixture": mixture_loader}


def flat(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    inputs, labels = batch
    return torch.cat([inputs, labels[:, -1:]], dim=1).flatten().tolist()


def take(loader, n: int) -> list[list[int]]:
    it = iter(loader)
    return [flat(next(it)) for _ in range(n)]


CASES = json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_states_of_the_previous_loader_resume_with_the_same_batches(tmp_path, name):
    case = CASES[name]
    build = BUILDERS[case["kind"]]
    for rank, expected in enumerate(case["expected"]):
        loader = build(tmp_path, case["world"], rank, case["workers"])
        loader.load_rank_states(SavedStates(case["saved"], rank))
        assert take(loader, len(expected)) == expected


@pytest.mark.parametrize("name", ["shards_reshard", "store_reshard", "mixture_reshard"])
def test_equal_states_of_one_dp_rank_are_counted_once(tmp_path, name):
    """With TP/PP/CP several global ranks share a dp rank and save equal loader states."""
    case = CASES[name]
    doubled = [s for s in case["saved"] for _ in range(2)]
    loader = BUILDERS[case["kind"]](tmp_path, case["world"], 0, case["workers"])
    loader.load_rank_states(SavedStates(doubled, 0))
    assert take(loader, 4) == case["expected"][0]
