"""A synthetic corpus in allenai/c4's file layout, for tests and the loader benchmark
(scripts/make_c4_mirror.py); runs read it as training.dataset = "c4" with a dataset path.

``write_c4_mirror(root, shards, docs_per_shard)`` writes root/en/c4-train.NNNNN-of-01024.json.gz
(and optionally c4-validation.NNNNN-of-00008.json.gz): gzip'd JSON lines with C4's fields text,
timestamp and url. The text is English-like (words of the stdlib's pydoc topics, so it tokenizes
like prose), deterministic for a given seed.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from titan.data.datasets import C4_SHARDS

__all__ = ["c4_shard_path", "write_c4_mirror"]


def c4_shard_path(root: Path, split: str, index: int) -> Path:
    total = C4_SHARDS[split]
    return Path(root) / "en" / f"c4-{split}.{index:05d}-of-{total:05d}.json.gz"


def _vocabulary() -> list[str]:
    from pydoc_data.topics import topics

    words = sorted({w for k in sorted(topics) for w in re.findall(r"[A-Za-z]+[,.]?", topics[k])})
    return words


def write_c4_mirror(
    root: str | Path,
    shards: int,
    docs_per_shard: int,
    *,
    split: str = "train",
    mean_words: int = 100,
    seed: int = 0,
    on_shard: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write ``shards`` files of ``docs_per_shard`` documents each (about ``mean_words`` words per
    document, lengths spread from 1/4x to 2x); returns their paths. ``on_shard(i)`` is called
    after each file (progress)."""
    words = _vocabulary()
    paths = []
    for i in range(shards):
        rng = random.Random(f"{seed}-{split}-{i}")
        path = c4_shard_path(Path(root), split, i)
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt", encoding="utf-8", compresslevel=6) as f:
            for j in range(docs_per_shard):
                n = rng.randint(max(1, mean_words // 4), mean_words * 2)
                text = " ".join(rng.choices(words, k=n)).capitalize() + "."
                row = {
                    "text": text,
                    "timestamp": f"2019-04-{1 + j % 28:02d}T{j % 24:02d}:00:00Z",
                    "url": f"https://example.com/{split}/{i}/{j}",
                }
                f.write(json.dumps(row) + "\n")
        paths.append(path)
        if on_shard is not None:
            on_shard(i)
    return paths
