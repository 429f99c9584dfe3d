"""A manifest of every file in a committed checkpoint (size + xxh3-64), and its verification.

Rank 0 writes ``MANIFEST.json`` after DCP finished (every rank's ``*.distcp`` and ``.metadata``
exist) and before the ``COMPLETE`` marker, so a committed checkpoint always has one. Loading
re-reads the files and compares: a truncated, emptied, missing or bit-flipped file is found before
DCP sees it (DCP would raise a multi-rank traceback, or, for flipped bytes in a tensor, load
silently wrong weights).
"""

from __future__ import annotations

import json
import os

import xxhash

MANIFEST = "MANIFEST.json"
_CHUNK = 8 << 20
# Written around the manifest (not covered by it): the marker and the temporary names.
_NOT_LISTED = ("COMPLETE", MANIFEST)


def file_digest(path: str) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _listed_files(folder: str) -> list[str]:
    return sorted(
        name
        for name in os.listdir(folder)
        if name not in _NOT_LISTED and not name.endswith(".tmp") and os.path.isfile(os.path.join(folder, name))
    )


def write_manifest(folder: str) -> None:
    files = {
        name: {"size": os.path.getsize(os.path.join(folder, name)), "xxh3_64": file_digest(os.path.join(folder, name))}
        for name in _listed_files(folder)
    }
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": 1, "hash": "xxh3_64", "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))


def verify(folder: str) -> str | None:
    """None if every file the manifest lists is there with its size and checksum; otherwise one
    phrase naming the first file that is not (``.metadata`` first: without it nothing loads)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return _verify_unlisted(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    for name in sorted(files, key=lambda n: n != ".metadata"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        size, want = os.path.getsize(path), files[name]["size"]
        if size != want:
            how = " (empty)" if size == 0 else " (truncated)" if size < want else ""
            return f"{name} is {size} bytes, {want} were written{how}"
        if file_digest(path) != files[name]["xxh3_64"]:
            return f"{name} has the right size but different bytes (checksum mismatch: corrupted on disk)"
    return None


def _verify_unlisted(folder: str) -> str | None:
    """A checkpoint from before manifests: at least DCP's .metadata must be there and parse."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    if not os.path.isfile(os.path.join(folder, ".metadata")):
        return ".metadata is missing"
    try:
        FileSystemReader(folder).read_metadata()
    except Exception as e:  # any parse failure: EOFError, UnpicklingError, ValueError, ...
        return f".metadata is unreadable ({type(e).__name__})"
    return None
