"""A node's in-memory snapshots on disk-like memory: the files of ``checkpoint.memory_folder``.

The folder is node-local memory that outlives the process (``/dev/shm``, a tmpfs: its files live
in host RAM until deleted or the node reboots). One job's snapshots are under
``<memory_folder>/titan-<name>-<hash of its checkpoint folder>/``:

- ``rank<R>/``: rank R's own snapshots;
- ``copy-of-rank<R>/``: a copy of rank R's snapshots that its ring peer (a rank on another node)
  received and keeps.

Each of these holds two slots, so a snapshot being written never touches the newest complete one.
A slot is ``slot<k>.data`` (the raw bytes of every tensor), ``slot<k>.meta`` (the rest of the state,
pickled, and where each tensor lies in the data) and ``slot<k>.json``, the manifest: the step, the
sizes and xxh3-64 checksums of the other two and the digests of the tensor layout and the run's
training-relevant config. Writing a slot removes its manifest first and writes it last (to a
temporary name, then renamed): a slot without a manifest is torn (its writer stopped mid-way) and
never read; reading checks both checksums.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

SLOTS = 2
_OWN, _COPY = "rank", "copy-of-rank"
_DIR = re.compile(r"^(rank|copy-of-rank)(\d+)$")
_ALIGN = 64


def job_folder(memory_folder: str, checkpoint_root: str) -> str:
    """This job's folder: named after its dump folder (for a user listing /dev/shm) plus a hash of
    the checkpoint folder's absolute path (unique per job, the same for every restart of it)."""
    path = os.path.abspath(checkpoint_root)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(os.path.dirname(path)) or "run")[:40]
    return os.path.join(memory_folder, f"titan-{name}-{hashlib.sha1(path.encode()).hexdigest()[:12]}")


def own_dir(root: str, rank: int) -> str:
    return os.path.join(root, f"{_OWN}{rank}")


def copy_dir(root: str, rank: int) -> str:
    return os.path.join(root, f"{_COPY}{rank}")


def aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def digest(data: Any) -> str:
    h = xxhash.xxh3_64()
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class Manifest:
    step: int
    rank: int
    data_bytes: int
    data_xxh: str
    meta_bytes: int
    meta_xxh: str
    layout: str
    config: str
    time: float = 0.0

    @classmethod
    def read(cls, path: str) -> Manifest | None:
        try:
            with open(path) as f:
                return cls(**json.load(f))
        except (OSError, ValueError, TypeError):
            return None


@dataclass(frozen=True)
class Held:
    """A complete snapshot of rank ``rank`` at ``step`` in one slot of ``folder``."""

    rank: int
    step: int
    folder: str
    slot: int
    layout: str
    config: str
    own: bool  # in the rank's own folder, or a peer's copy


class Slot:
    """One slot of a snapshot folder: its data file mapped into memory (kept mapped between
    snapshots: the same bytes are rewritten every time), its meta file and its manifest."""

    def __init__(self, folder: str, index: int) -> None:
        self.folder, self.index = folder, index
        self.data_path = os.path.join(folder, f"slot{index}.data")
        self.meta_path = os.path.join(folder, f"slot{index}.meta")
        self.manifest_path = os.path.join(folder, f"slot{index}.json")
        self._map: mmap.mmap | None = None
        self._buffer: torch.Tensor | None = None
        self._writable = False

    def manifest(self) -> Manifest | None:
        return Manifest.read(self.manifest_path)

    def torn(self) -> bool:
        """Data on disk but no manifest: its writer stopped before the end."""
        return os.path.exists(self.data_path) and not os.path.exists(self.manifest_path)

    def invalidate(self) -> None:
        """Before the slot is rewritten: from here until the new manifest it is torn."""
        try:
            os.remove(self.manifest_path)
        except FileNotFoundError:
            pass

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The data file as a writable uint8 tensor of ``nbytes`` (allocated in full up front: a
        tmpfs without room fails here with ENOSPC, not later with SIGBUS in a copy)."""
        if self._buffer is not None and self._buffer.numel() == nbytes and self._writable:
            return self._buffer
        self.close()
        os.makedirs(self.folder, exist_ok=True)
        fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
            self._map = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self._writable = True
        self._buffer = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else _empty()
        return self._buffer

    def read_buffer(self, nbytes: int) -> torch.Tensor:
        """The data file, mapped read-only (a snapshot being loaded or sent)."""
        self.close()
        fd = os.open(self.data_path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise OSError(f"{self.data_path} holds {size} bytes, its manifest says {nbytes}")
            if nbytes:
                self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._writable = False
        self._buffer = _readonly_tensor(memoryview(self._map)) if self._map is not None else _empty()
        return self._buffer

    def buffer_for_send(self, nbytes: int) -> torch.Tensor:
        """The data as mapped now (just written), else mapped read-only."""
        if self._buffer is not None and self._buffer.numel() == nbytes:
            return self._buffer
        return self.read_buffer(nbytes)

    def write_meta(self, meta: bytes) -> None:
        _write_atomic(self.meta_path, meta)

    def read_meta(self, manifest: Manifest) -> bytes:
        with open(self.meta_path, "rb") as f:
            meta = f.read()
        if len(meta) != manifest.meta_bytes or digest(meta) != manifest.meta_xxh:
            raise OSError(f"{self.meta_path} does not match its manifest (size or checksum)")
        return meta

    def commit(self, manifest: Manifest) -> None:
        _write_atomic(self.manifest_path, json.dumps(manifest.__dict__).encode())

    def data_digest(self) -> str:
        if self._map is None or self._buffer is None:
            return digest(b"")
        return digest(memoryview(self._map)[: self._buffer.numel()])

    def close(self) -> None:
        self._buffer = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor still views it: the mapping goes when that tensor does
                pass
            self._map = None


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _readonly_tensor(view: memoryview) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # read only: restoring copies out of it
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        return torch.frombuffer(view, dtype=torch.uint8)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class SnapshotFolder:
    """The two slots of one snapshot folder (a rank's own, or a copy it keeps for its peer)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.slots = [Slot(folder, k) for k in range(SLOTS)]

    def next_slot(self) -> Slot:
        """The slot to write next: never the one holding the newest complete snapshot."""
        steps = [(m.step if (m := s.manifest()) is not None else -1) for s in self.slots]
        return self.slots[steps.index(min(steps))]

    def complete(self) -> list[tuple[Slot, Manifest]]:
        return [(s, m) for s in self.slots if (m := s.manifest()) is not None]

    def torn(self) -> bool:
        return any(s.torn() for s in self.slots)

    def drop(self, keep_step: int | None = None) -> None:
        """Remove every slot (but the one of ``keep_step``), the manifest first."""
        for s in self.slots:
            m = s.manifest()
            if keep_step is not None and m is not None and m.step == keep_step:
                continue
            s.invalidate()
            s.close()
            for path in (s.data_path, s.meta_path):
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        for s in self.slots:
            s.close()


def inventory(root: str) -> tuple[list[Held], list[int]]:
    """Every complete snapshot under a job folder (own ones and copies), and the ranks whose own
    folder holds a torn slot."""
    held, torn = [], []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return [], []
    for name in names:
        m = _DIR.match(name)
        if not m:
            continue
        rank, folder = int(m[2]), SnapshotFolder(os.path.join(root, name))
        own = m[1] == _OWN
        if own and folder.torn():
            torn.append(rank)
        for slot, man in folder.complete():
            if man.rank == rank:
                held.append(Held(rank, man.step, folder.folder, slot.index, man.layout, man.config, own))
    return held, torn


def remove_job_folder(root: str, keep: set[str]) -> None:
    """Remove the folders of ``root`` not named in ``keep`` (stale ones of ranks no longer here),
    and ``root`` itself when nothing is left."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        if name not in keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    remove_if_empty(root)


def remove_if_empty(root: str) -> None:
    """Remove ``root`` if no rank's folder is left in it. Ranks end at their own pace, so another
    rank may have removed it already, or still be writing into it: both leave it to them."""
    try:
        os.rmdir(root)
    except OSError:
        pass


def new_manifest(
    step: int, rank: int, data_bytes: int, data_xxh: str, meta: bytes, layout: str, config: str
) -> Manifest:
    return Manifest(step, rank, data_bytes, data_xxh, len(meta), digest(meta), layout, config, time.time())
