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
import queue
import signal
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
    FORMAT,
    MANIFEST,
    VERSION,
    shard_entry,
    shard_intact,
    token_dtype,
    tokenizer_fingerprint,
    write_atomic,
    write_shard,
)

__all__ = ["tokenize_to_store"]

_PLAN = "plan.json"


def _shard_name(index: int) -> str:
    return f"{index:05d}"


def _encode_shard(tokenizer: Any, folder: str, index: int, texts: list[str], dtype_name: str) -> dict:
    docs = [tokenizer.encode(t, bos=True, eos=True) for t in texts]
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return write_shard(Path(folder), _shard_name(index), docs, np.dtype(dtype_name), text_bytes)


def _worker_loop(tokenizer_path: str, folder: str, dtype_name: str, tasks, results) -> None:
    """A tokenizer process: builds the tokenizer once, then writes the shards it is handed until None."""
    from .tokenizer import build_tokenizer

    # Ctrl-C on a terminal reaches every process of the group: the main process stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokenizer = build_tokenizer(tokenizer_path)
    while (task := tasks.get()) is not None:
        index, texts = task
        try:
            results.put((index, _encode_shard(tokenizer, folder, index, texts, dtype_name), ""))
        except Exception as e:  # handed back as one line, raised by the main process
            results.put((index, None, f"{type(e).__name__}: {e}".splitlines()[0]))


class _Workers:
    """``n`` tokenizer processes fed through a bounded queue: at most 2 shards of text per worker
    wait in memory, so reading never runs far ahead of tokenizing."""

    def __init__(self, n: int, tokenizer_path: str, folder: str, dtype_name: str) -> None:
        ctx = mp.get_context("spawn")
        self.tasks, self.results = ctx.Queue(maxsize=2 * n), ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker_loop, args=(tokenizer_path, folder, dtype_name, self.tasks, self.results), daemon=True
            )
            for _ in range(n)
        ]
        self.pending = 0

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def _check_alive(self) -> None:
        dead = [p.exitcode for p in self.procs if not p.is_alive() and p.exitcode not in (0, None)]
        if dead:
            raise TitanError(f"a tokenizer process died (exit code {dead[0]}); finished shards are kept, re-run")

    def submit(self, index: int, texts: list[str]) -> list[tuple[int, dict]]:
        """Queue one shard; returns the shards finished meanwhile."""
        done = []
        while True:
            try:
                self.tasks.put((index, texts), timeout=1.0)
                self.pending += 1
                return done + self.finished(block=False)
            except queue.Full:
                done += self.finished(block=False)
                self._check_alive()

    def finished(self, block: bool) -> list[tuple[int, dict]]:
        out = []
        while self.pending:
            try:
                index, entry, error = self.results.get(timeout=1.0 if block else 0.01)
            except queue.Empty:
                if not block:
                    return out
                self._check_alive()
                continue
            self.pending -= 1
            if error:
                raise TitanError(f"tokenizing shard {index} failed: {error}")
            out.append((index, entry))
        return out

    def close(self) -> None:
        # text still buffered for the pipe (an interrupted run) is dropped: the workers are stopped, and
        # waiting to flush it at exit would hang
        self.tasks.cancel_join_thread()
        self.results.cancel_join_thread()
        for p in self.procs:
            if p.pid is None:  # never started (interrupted while starting the others)
                continue
            if p.is_alive():
                p.terminate()
            p.join()


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
            raise TitanError(
                f"output folder {str(out)!r} holds shards of another run ({_PLAN}: {old}); this run: "
                f"{plan}; use an empty folder or the same dataset, tokenizer and --shard_mb"
            )
    else:
        write_atomic(file, json.dumps(plan, indent=1))


# recorded in the plan and manifest only when set, so stores made before these keys keep matching
_HUB_KEYS = ("dataset_config", "dataset_split")


def tokenize_to_store(
    *,
    dataset: str,
    dataset_path: str,
    tokenizer_path: str,
    out: str,
    workers: int,
    text_field: str = "text",
    txt_split: str = "paragraph",
    bad_lines: str = "fail",
    shard_mb: float = 64.0,
    dataset_config: str = "",
    dataset_split: str = "",
) -> dict:
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
    source = build_source(
        dataset, dataset_path, text_field, txt_split, bad_lines, config=dataset_config, split=dataset_split
    )
    folder = Path(out).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    for tmp in folder.glob("*.tmp"):  # left by an interrupted run; never part of a finished shard
        tmp.unlink()
    dtype = token_dtype(tokenizer.vocab_size)
    hub_keys = {"dataset_config": dataset_config, "dataset_split": dataset_split}
    if not dataset_config and dataset_split in ("", "train"):
        hub_keys = {}
    plan = {
        "dataset": dataset,
        "dataset_path": dataset_path,
        **hub_keys,
        "text_field": text_field,
        "txt_split": txt_split,
        "tokenizer": fingerprint["fingerprint"],
        "shard_mb": shard_mb,
    }
    _check_plan(folder, plan)
    if (folder / MANIFEST).exists():
        (folder / MANIFEST).unlink()  # rewritten when every shard is verified again
    entries: dict[int, dict] = {}
    kept = 0
    pool = _Workers(workers, tokenizer_path, str(folder), dtype.name) if workers > 0 else None
    bar = progress(desc="tokenizing", unit="MB")

    def record(done: list[tuple[int, dict]]) -> None:
        for i, entry in done:
            entries[i] = entry
            bar.update(entry["text_bytes"] / 1e6)

    try:
        if pool is not None:
            pool.start()
        for index, texts in enumerate(_chunks(source.iter_docs(0), int(shard_mb * 1e6))):
            old = shard_entry(folder, _shard_name(index))
            if old is not None and shard_intact(folder, old, dtype.itemsize):
                kept += 1
                record([(index, old)])
            elif pool is None:
                record([(index, _encode_shard(tokenizer, str(folder), index, texts, dtype.name))])
            else:
                record(pool.submit(index, texts))
        if pool is not None:
            record(pool.finished(block=True))
    finally:
        if pool is not None:
            pool.close()
        bar.close()
    if not entries or sum(e["tokens"] for e in entries.values()) == 0:
        raise TitanError(f"dataset {dataset_path or dataset!r} yielded no documents; nothing to tokenize")
    shards = [entries[i] for i in sorted(entries)]
    totals = {k: sum(e[k] for e in shards) for k in ("text_bytes", "documents", "tokens")}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": fingerprint,
        "bos": True,
        "eos": True,
        "documents_as": "BOS + tokens + EOS, concatenated in source order",
        "dtype": dtype.name,
        "source": {k: plan[k] for k in ("dataset", "dataset_path", "text_field", "txt_split", *_HUB_KEYS) if k in plan},
        **totals,
        "shards": shards,
    }
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    seconds = time.perf_counter() - start
    logger.info(
        f"token store {out}: {len(shards)} shard(s) ({kept} kept from an earlier run), "
        f"{totals['documents']:,} documents, {totals['tokens']:,} tokens in {seconds:.1f} s"
    )
    return {**totals, "seconds": round(seconds, 3), "shards": len(shards), "kept": kept}
