"""Token stores: a dataset tokenized once, read at train time straight from memory maps.

A store is a folder:

- ``manifest.json`` (written last; its presence marks a complete store): format and version, the
  tokenizer's fingerprint, vocabulary size and BOS/EOS ids, the BOS/EOS policy (every document is
  ``BOS + tokens + EOS``, as the online loader packs it), the token dtype, and per shard its
  token and document counts, text bytes and xxh3-64 checksums;
- per shard ``NNNNN.tokens`` (a flat array of token ids, uint16 when the vocabulary fits, else
  uint32) and ``NNNNN.offsets`` (int64, documents + 1 entries: document d is tokens
  ``offsets[d]:offsets[d + 1]``), plus ``NNNNN.json``, the shard's manifest entry, written after
  its two files (that is how a re-run knows the shard is finished).

Every file is written under a temporary name, flushed to disk and renamed, so an interrupted
write never leaves a file that looks complete. The shards concatenated are the token stream the
online loader would pack from the same documents; a window index maps to a token offset by
arithmetic, so reading any position costs one binary search over the shard starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from titan.errors import TitanError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "VERSION",
    "TokenStore",
    "is_token_store",
    "shard_entry",
    "token_dtype",
    "tokenizer_fingerprint",
    "write_atomic",
    "write_shard",
]

FORMAT = "titan-token-store"
VERSION = 1
MANIFEST = "manifest.json"
_RETOKENIZE = "re-run scripts/tokenize_dataset.py with the same --out to repair it"
_SHARD_KEYS = ("name", "tokens", "documents", "text_bytes", "tokens_xxh3", "offsets_xxh3")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenizer_fingerprint(tokenizer: Any) -> dict:
    """What identifies a tokenizer's output: a hash of its file(s) and its vocabulary size and
    special ids. A tokenizer without a readable file is hashed by its class and ids."""
    import xxhash

    h = xxhash.xxh3_64()
    path = str(getattr(tokenizer, "path", "") or "")
    files = [Path(path)] if path and Path(path).is_file() else []
    if files and (files[0].parent / "tokenizer_config.json").is_file() and files[0].suffix == ".json":
        files.append(files[0].parent / "tokenizer_config.json")  # BOS/EOS come from it
    for f in files:
        h.update(f.read_bytes())
    if not files:
        h.update(f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}".encode())
    vocab, bos, eos = int(tokenizer.vocab_size), int(tokenizer.bos_id), int(tokenizer.eos_id)
    h.update(f"{vocab}:{bos}:{eos}".encode())
    return {"fingerprint": h.hexdigest(), "path": path, "vocab_size": vocab, "bos_id": bos, "eos_id": eos}


def is_token_store(path: str) -> bool:
    return bool(path) and (Path(path).expanduser() / MANIFEST).is_file()


def file_hash(path: Path) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _fsync_rename(tmp: Path, final: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    _fsync_rename(tmp, path)


def _write_array(path: Path, values: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if values.size:
        out = np.memmap(tmp, dtype=values.dtype, mode="w+", shape=values.shape)
        out[:] = values
        out.flush()
        del out
    else:  # a zero-length memmap cannot be created
        tmp.write_bytes(b"")
    _fsync_rename(tmp, path)


def shard_entry(folder: Path, name: str) -> dict | None:
    """The finished shard's manifest entry, or None when the shard was not finished."""
    try:
        entry = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return entry if isinstance(entry, dict) and all(k in entry for k in _SHARD_KEYS) else None


def write_shard(folder: Path, name: str, docs: list[list[int]], dtype: np.dtype, text_bytes: int) -> dict:
    """Write one shard (tokens, offsets, then its entry) and return the entry."""
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((t for d in docs for t in d), dtype=dtype, count=int(offsets[-1]))
    _write_array(folder / f"{name}.tokens", tokens)
    _write_array(folder / f"{name}.offsets", offsets)
    entry = {
        "name": name,
        "tokens": int(offsets[-1]),
        "documents": len(docs),
        "text_bytes": text_bytes,
        "tokens_xxh3": file_hash(folder / f"{name}.tokens"),
        "offsets_xxh3": file_hash(folder / f"{name}.offsets"),
    }
    write_atomic(folder / f"{name}.json", json.dumps(entry))
    return entry


def shard_intact(folder: Path, entry: dict, itemsize: int) -> bool:
    """Sizes and checksums of a finished shard's files match its entry (reads the whole shard)."""
    tok, off = folder / f"{entry['name']}.tokens", folder / f"{entry['name']}.offsets"
    try:
        sizes_ok = (
            tok.stat().st_size == entry["tokens"] * itemsize and off.stat().st_size == (entry["documents"] + 1) * 8
        )
    except OSError:
        return False
    return sizes_ok and file_hash(tok) == entry["tokens_xxh3"] and file_hash(off) == entry["offsets_xxh3"]


class TokenStore:
    """A token store opened for reading: the manifest checked, every shard's file sizes checked
    against it (O(shards), no data read); shards are memory-mapped when first read."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self.folder = Path(path).expanduser()
        self.manifest = self._load_manifest()
        m = self.manifest
        self.dtype = np.dtype(m["dtype"])
        self.shards: list[dict] = m["shards"]
        counts = np.array([s["tokens"] for s in self.shards], dtype=np.int64)
        self.starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.starts[1:])
        self.num_tokens = int(self.starts[-1])
        self.num_documents = sum(int(s["documents"]) for s in self.shards)
        self.text_bytes = sum(int(s["text_bytes"]) for s in self.shards)
        # the loader state names its dataset: the store's content, wherever the folder is mounted
        import xxhash

        content = xxhash.xxh3_64("".join(s["tokens_xxh3"] for s in self.shards).encode()).hexdigest()
        self.name = f"store:{self.folder.name}:{content}"
        self._maps: dict[int, np.ndarray] = {}
        self._check_sizes()

    def _bad(self, what: str) -> TitanError:
        return TitanError(f"token store {self.path!r}: {MANIFEST} {what}; {_RETOKENIZE}")

    def _load_manifest(self) -> dict:
        file = self.folder / MANIFEST
        try:
            m = json.loads(file.read_text(encoding="utf-8"))
        except OSError as e:
            raise TitanError(f"token store {self.path!r}: cannot read {MANIFEST} ({e.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._bad(f"is not valid JSON ({e})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise self._bad(f'is not a {FORMAT} manifest (no "format": "{FORMAT}")')
        if m.get("version") != VERSION:
            raise self._bad(f"has version {m.get('version')!r}; this titan reads version {VERSION}")
        tok = m.get("tokenizer")
        if not isinstance(tok, dict) or not all(k in tok for k in ("fingerprint", "vocab_size", "bos_id", "eos_id")):
            raise self._bad("has no tokenizer fingerprint (tokenizer.fingerprint/vocab_size/bos_id/eos_id)")
        if m.get("dtype") not in ("uint16", "uint32"):
            raise self._bad(f"has dtype {m.get('dtype')!r}; valid: uint16, uint32")
        shards = m.get("shards")
        if not isinstance(shards, list) or not shards:
            raise self._bad("lists no shards")
        for i, s in enumerate(shards):
            if not isinstance(s, dict) or not all(k in s for k in _SHARD_KEYS):
                raise self._bad(f"shard entry {i} lacks one of {list(_SHARD_KEYS)}")
            for k in ("tokens", "documents", "text_bytes"):
                if not isinstance(s[k], int) or isinstance(s[k], bool) or s[k] < 0:
                    raise self._bad(f"shard entry {i} has {k} = {s[k]!r}, expected an integer >= 0")
        return m

    def _check_sizes(self) -> None:
        itemsize = self.dtype.itemsize
        for s in self.shards:
            for suffix, want in (("tokens", s["tokens"] * itemsize), ("offsets", (s["documents"] + 1) * 8)):
                f = self.folder / f"{s['name']}.{suffix}"
                try:
                    got = f.stat().st_size
                except OSError:
                    raise TitanError(
                        f"token store {self.path!r}: shard file {f.name} is missing; {_RETOKENIZE}"
                    ) from None
                if got != want:
                    raise TitanError(
                        f"token store {self.path!r}: shard file {f.name} has {got} bytes, the manifest "
                        f"says {want} (truncated or overwritten); {_RETOKENIZE}"
                    )

    def check_tokenizer(self, tokenizer: Any, key: str = "model.tokenizer_path") -> None:
        """Refuse a run whose tokenizer is not the one the store was made with."""
        mine = tokenizer_fingerprint(tokenizer)
        theirs = self.manifest["tokenizer"]
        if mine["fingerprint"] != theirs["fingerprint"]:
            raise TitanError(
                f"token store {self.path!r} was made with tokenizer {theirs.get('path') or '(unnamed)'!r} "
                f"(fingerprint {theirs['fingerprint']}, vocab {theirs['vocab_size']}), this run uses "
                f"{mine['path'] or '(unnamed)'!r} (fingerprint {mine['fingerprint']}, vocab {mine['vocab_size']}); "
                f"set {key} to the store's tokenizer or tokenize the data again"
            )

    def num_windows(self, seq_len: int) -> int:
        """Whole windows of seq_len + 1 tokens in one epoch (the tail shorter than a window is
        not read)."""
        return self.num_tokens // (seq_len + 1)

    def _map(self, shard: int) -> np.ndarray:
        m = self._maps.get(shard)
        if m is None:
            s = self.shards[shard]
            f = self.folder / f"{s['name']}.tokens"
            # a zero-length file cannot be memory-mapped
            m = (
                np.memmap(f, dtype=self.dtype, mode="r", shape=(s["tokens"],))
                if s["tokens"]
                else np.zeros(0, self.dtype)
            )
            self._maps[shard] = m
        return m

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens start .. start + count - 1 of the concatenated shards."""
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        offset = start - int(self.starts[shard])
        m = self._map(shard)
        if offset + count <= len(m):
            return m[offset : offset + count]
        parts, left = [], count
        while left > 0:
            m = self._map(shard)
            piece = m[offset : offset + left]
            parts.append(piece)
            left -= len(piece)
            shard, offset = shard + 1, 0
        return np.concatenate(parts)

    def shard_bytes(self, shard: int) -> int:
        return self.shards[shard]["tokens"] * self.dtype.itemsize
