"""Tokenize a dataset once into a token store (titan/data/token_store.py); scripts/tokenize_dataset.py.

The documents are read in order by this process from the same source the online loader reads
(the dataset registry and local files: titan/data/datasets.py), cut into shards of about
``shard_mb`` MB of text, and each shard is tokenized and written by a worker process. Shards are
written atomically; a re-run keeps every shard whose entry and checksums are intact (it parses
the documents again to find where the next shard starts, but does not tokenize them) and the
manifest is written last. The output folder remembers its plan (dataset, tokenizer, shard size):
a re-run with another plan is refused instead of mixing two stores.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from titan.errors import TitanError
from titan.log import logger
from titan.progress import progress

from .datasets import build_source
from .token_store import (
    FORMAT, MANIFEST, VERSION, shard_entry, shard_intact, token_dtype, tokenizer_fingerprint, write_atomic, write_shard,
)

__all__ = ["tokenize_to_store"]

_PLAN = "plan.json"


def _shard_name(index: int) -> str:
    return f"{index:05d}"


def _encode_shard(tokenizer: Any, folder: str, index: int, texts: list[str], dtype_name: str) -> dict:
    docs = [tokenizer.encode(t, bos=True, eos=True) for t in texts]
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return write_shard(Path(folder), _shard_name(index), docs, np.dtype(dtype_name), text_bytes)


def _worker_shard(tokenizer_path: str, folder: str, index: int, texts: list[str], dtype_name: str) -> dict:
    from .tokenizer import build_tokenizer

    # built per shard (a shard is seconds of work): no per-process state to keep
    return _encode_shard(build_tokenizer(tokenizer_path), folder, index, texts, dtype_name)


def _chunks(docs: Iterator[str], shard_bytes: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    size = 0
    for text in docs:
        chunk.append(text)
        size += len(text)  # characters: cheap, and the cut only has to be deterministic
        if size >= shard_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _check_plan(out: Path, plan: dict) -> None:
    file = out / _PLAN
    if file.is_file():
        try:
            old = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            old = None
        if old != plan:
            raise TitanError(f"output folder {str(out)!r} holds shards of another run ({_PLAN}: {old}); this run: "
                             f"{plan}; use an empty folder or the same dataset, tokenizer and --shard_mb")
    else:
        write_atomic(file, json.dumps(plan, indent=1))


def tokenize_to_store(*, dataset: str, dataset_path: str, tokenizer_path: str, out: str, workers: int,
                      text_field: str = "text", txt_split: str = "paragraph", bad_lines: str = "fail",
                      shard_mb: float = 64.0) -> dict:
    """Write (or finish) the token store in ``out``; returns the totals of the whole store and
    this run's seconds: {"text_bytes", "documents", "tokens", "seconds", "shards", "kept"}."""
    from .tokenizer import build_tokenizer

    start = time.perf_counter()
    if workers < 0:
        raise TitanError(f"--workers {workers} must be >= 0 (0: tokenize in this process)")
    if shard_mb <= 0:
        raise TitanError(f"--shard_mb {shard_mb} must be > 0")
    tokenizer = build_tokenizer(tokenizer_path)
    fingerprint = tokenizer_fingerprint(tokenizer)
    source = build_source(dataset, dataset_path, text_field, txt_split, bad_lines)
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    for tmp in folder.glob("*.tmp"):  # left by an interrupted run; never part of a finished shard
        tmp.unlink()
    dtype = token_dtype(tokenizer.vocab_size)
    plan = {"dataset": dataset, "dataset_path": dataset_path, "text_field": text_field, "txt_split": txt_split,
            "tokenizer": fingerprint["fingerprint"], "shard_mb": shard_mb}
    _check_plan(folder, plan)
    if (folder / MANIFEST).exists():
        (folder / MANIFEST).unlink()  # rewritten when every shard is verified again
    entries: dict[int, dict] = {}
    kept = 0
    pool = mp.get_context("spawn").Pool(workers) if workers > 0 else None
    inflight: list[tuple[int, Any]] = []
    bar = progress(desc="tokenizing", unit="MB")
    try:
        for index, texts in enumerate(_chunks(source.iter_docs(0), int(shard_mb * 1e6))):
            mb = sum(len(t) for t in texts) / 1e6
            old = shard_entry(folder, _shard_name(index))
            if old is not None and shard_intact(folder, old, dtype.itemsize):
                entries[index], kept = old, kept + 1
                bar.update(mb)
                continue
            if pool is None:
                entries[index] = _encode_shard(tokenizer, str(folder), index, texts, dtype.name)
                bar.update(mb)
                continue
            inflight.append((index, pool.apply_async(_worker_shard, (tokenizer_path, str(folder), index, texts, dtype.name))))
            while len(inflight) >= 2 * workers:  # bounded: the text of at most 2 shards per worker in memory
                i, result = inflight.pop(0)
                entries[i] = result.get()
                bar.update(entries[i]["text_bytes"] / 1e6)
        for i, result in inflight:
            entries[i] = result.get()
            bar.update(entries[i]["text_bytes"] / 1e6)
        if pool is not None:
            pool.close()
            pool.join()
    finally:
        if pool is not None:
            pool.terminate()
        bar.close()
    if not entries or sum(e["tokens"] for e in entries.values()) == 0:
        raise TitanError(f"dataset {dataset_path or dataset!r} yielded no documents; nothing to tokenize")
    shards = [entries[i] for i in sorted(entries)]
    totals = {k: sum(e[k] for e in shards) for k in ("text_bytes", "documents", "tokens")}
    manifest = {
        "format": FORMAT, "version": VERSION, "tokenizer": fingerprint, "bos": True, "eos": True,
        "documents_as": "BOS + tokens + EOS, concatenated in source order", "dtype": dtype.name,
        "source": {k: plan[k] for k in ("dataset", "dataset_path", "text_field", "txt_split")},
        **totals, "shards": shards,
    }
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    seconds = time.perf_counter() - start
    logger.info(f"token store {out}: {len(shards)} shard(s) ({kept} kept from an earlier run), "
                f"{totals['documents']:,} documents, {totals['tokens']:,} tokens in {seconds:.1f} s")
    return {**totals, "seconds": round(seconds, 3), "shards": len(shards), "kept": kept}
