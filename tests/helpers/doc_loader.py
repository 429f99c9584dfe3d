"""A loader over a small list of numbered documents whose every token names its document, for the
data tests that check what each rank read (tests/unit/data)."""

from __future__ import annotations

from titan.data.datasets import ListSource
from titan.data.loader import TitanDataLoader


class DocTokenizer:
    """Doc "i:n" -> BOS, n tokens 1000*i + j, EOS: every non-special token names its document."""

    vocab_size, bos_id, eos_id = 10**9, 0, 1

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        i, n = map(int, text.split(":"))
        return [self.bos_id] * bos + [1000 * (i + 1) + j for j in range(n)] + [self.eos_id] * eos


N_DOCS = 37
DOC_SOURCE = ListSource("docs", [f"{i}:{(i * 7) % 23 + 1}" for i in range(N_DOCS)])  # 1..23 tokens


def make(world=1, rank=0, workers=0, infinite=True, seq_len=7, batch=2, source=DOC_SOURCE):
    return TitanDataLoader(
        source,
        DocTokenizer(),
        seq_len=seq_len,
        local_batch_size=batch,
        dp_rank=rank,
        dp_world_size=world,
        num_workers=workers,
        infinite=infinite,
    )


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]
