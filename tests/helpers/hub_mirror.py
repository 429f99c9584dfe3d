"""A synthetic dataset in the Hugging Face hub's layout, as `hf download ID --repo-type dataset
--local-dir DIR` writes it: data files in folders plus the card README.md whose YAML header lists
``configs:``, each choosing its data files per split. Three configs, two formats:

- ``sample-10BT``: ``sample/10BT/NNN_00000.parquet`` (FineWeb-Edu's naming), split train;
- ``default``: ``data/train-NNNNN-of-MMMMM.parquet``, split train;
- ``code``: ``code/{train,validation}-NNNNN.jsonl.gz`` with the text in column ``content``.

The text is English-like (words of the stdlib's pydoc topics) and deterministic for a seed.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["CARD", "ROW_GROUP", "HubMirror", "write_hub_mirror"]

ROW_GROUP = 5  # rows per parquet row group

CARD = """---
license: odc-by
pretty_name: titan test corpus
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
- config_name: code
  data_files:
  - split: train
    path: code/train-*
  - split: validation
    path: code/validation-*
---

# titan test corpus

Written by tests/helpers/hub_mirror.py in the layout of a hub dataset repository.
"""


def _words() -> list[str]:
    from pydoc_data.topics import topics

    return sorted({w for k in sorted(topics) for w in re.findall(r"[A-Za-z]+[,.]?", topics[k])})


class HubMirror:
    """The mirror's root and, per (config, split), its files and their documents in order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[tuple[str, str], list[Path]] = {}
        self.docs: dict[Path, list[str]] = {}

    def shard_docs(self, config: str, split: str = "train") -> list[list[str]]:
        return [self.docs[f] for f in self.files[(config, split)]]


def write_hub_mirror(
    root: str | Path,
    *,
    sample_files: int = 6,
    default_files: int = 2,
    code_files: int = 3,
    docs_per_file: int = 24,
    mean_words: int = 40,
    seed: int = 0,
) -> HubMirror:
    words, rng = _words(), random.Random(seed)
    mirror = HubMirror(Path(root))

    def texts() -> list[str]:
        return [
            " ".join(rng.choice(words) for _ in range(rng.randint(mean_words // 4, 2 * mean_words)))
            for _ in range(docs_per_file)
        ]

    def parquet(path: Path, docs: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        ids = [f"<urn:uuid:{path.stem}-{i}>" for i in range(len(docs))]
        table = pa.table({"text": docs, "id": ids, "score": [float(len(d)) for d in docs]})
        pq.write_table(table, path, row_group_size=ROW_GROUP)  # several row groups, as hub files have

    def jsonl_gz(path: Path, docs: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt", encoding="utf-8") as f:
            for i, d in enumerate(docs):
                f.write(json.dumps({"content": d, "repo": f"r{i}"}) + "\n")

    layout = [
        ("sample-10BT", "train", [f"sample/10BT/{i:03d}_00000.parquet" for i in range(sample_files)], parquet),
        (
            "default",
            "train",
            [f"data/train-{i:05d}-of-{default_files:05d}.parquet" for i in range(default_files)],
            parquet,
        ),
        ("code", "train", [f"code/train-{i:05d}.jsonl.gz" for i in range(code_files)], jsonl_gz),
        ("code", "validation", [f"code/validation-{i:05d}.jsonl.gz" for i in range(2)], jsonl_gz),
    ]
    for config, split, names, write in layout:
        paths = [mirror.root / n for n in names]
        for p in paths:
            mirror.docs[p] = texts()
            write(p, mirror.docs[p])
        mirror.files[(config, split)] = paths
    (mirror.root / "README.md").write_text(CARD, encoding="utf-8")
    # what hf download leaves beside the files: its own metadata, never data
    meta = mirror.root / ".cache" / "huggingface"
    (meta / "download" / "sample" / "10BT").mkdir(parents=True, exist_ok=True)
    (meta / ".gitignore").write_text("*\n")
    for p in mirror.files[("sample-10BT", "train")]:
        (meta / "download" / "sample" / "10BT" / f"{p.name}.metadata").write_text("0123abcd\n0123abcd\n1.0\n")
    return mirror
