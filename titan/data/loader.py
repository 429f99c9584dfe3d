"""The stateful, DP-aware data loader.

Layout: DP rank r with K = max(1, num_workers) loader workers runs K *streams*, slots r + W*k
(W = DP world size), stride W*K (see titan/data/packing.py for what a stream owns). A source with
at least W*K shards is dealt by whole shards (each rank reads ~1/W of the files); otherwise by
documents (every stream parses the whole stream). Worker k runs one stream and yields whole
batches; ``StatefulDataLoader`` hands them out round-robin (in order), so the rank's batch
sequence is the interleaving stream 0, 1, ..., K-1, 0, 1, ...

Exact state with workers: every batch travels with its stream's state *after* that batch; the
loader records it only when the batch is handed to the caller, so prefetched batches never leak
into a checkpoint. ``state_dict()`` lists the K stream states starting with the one whose batch
comes next; on restore worker k runs the k-th of them, so a fresh loader continues exactly where
the old one stopped. (The stream's identity lives in its state, not in the worker id.)
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan.errors import TitanError
from titan.log import logger

from .datasets import build_source
from .packing import new_stream_state, next_position, pack_stream, reshard_states
from .sources import DocumentSource

__all__ = ["PackedDataset", "TitanDataLoader", "build_dataloader", "choose_layout"]

STATE_VERSION = 2


def choose_layout(num_shards: int, num_streams: int) -> str:
    """Whole shards per stream when every stream gets at least one, else documents."""
    return "shards" if num_shards > 1 and num_shards >= num_streams else "documents"


def _upgrade_v1(state: dict) -> dict:
    """A version-1 state (documents dealt, no ``cur``) in the version-2 format."""
    state = copy.deepcopy(state)
    for st in state["streams"]:
        st["pending"] = [[p, 0] for p in st["pending"]]
        st["segments"] = [[p, 0, off] for p, off in st["segments"]]
        st["cur"], st["num_units"], st["docs"] = None, st.pop("num_docs"), 0
    state.update(version=STATE_VERSION, layout="documents")
    return state


def _passthrough(item):
    return item


class PackedDataset(IterableDataset):
    """Stateful IterableDataset: one stream per worker; yields (inputs, labels, worker, state).

    ``inputs``/``labels`` are None on the final item of a finite stream (it only carries the state).
    """

    def __init__(self, source: DocumentSource, tokenizer, states: list[dict], *, layout: str, seq_len: int,
                 batch_size: int, infinite: bool, dp_rank: int = 0) -> None:
        self.source = source
        self.layout = layout
        self.tokenizer = tokenizer
        self.states = states
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.infinite = infinite
        self.dp_rank = dp_rank
        self._live: dict | None = None

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        k, n = (info.id, info.num_workers) if info is not None else (0, 1)
        if n != len(self.states):
            raise RuntimeError(f"PackedDataset has {len(self.states)} stream states for {n} workers")
        self._live = self.states[k]
        stream = self._stream(self._live, f" (dp rank {self.dp_rank}, stream {self._live['slot']})")
        try:
            for windows, state, opened in stream:
                self._live = state
                if windows is None:
                    yield None, None, k, state, opened
                else:
                    yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous(), k, state, opened
        except TitanError as e:
            if info is None:
                raise
            # from a worker process the DataLoader would re-raise it with the worker's traceback
            # folded into the message; hand the one line over as an item instead
            yield "error", str(e), k, None, []

    def _stream(self, state: dict, label: str) -> Iterator[tuple[torch.Tensor | None, dict, list[int]]]:
        return pack_stream(self.source, self.tokenizer, state, layout=self.layout, seq_len=self.seq_len,
                           batch_size=self.batch_size, infinite=self.infinite, label=label)

    def state_dict(self) -> dict:
        return {"stream": copy.deepcopy(self._live if self._live is not None else self.states[0])}

    def load_state_dict(self, state: dict) -> None:
        self.states = [copy.deepcopy(state["stream"])]


class TitanDataLoader:
    """Yields ``(input_ids, labels)``, LongTensors [local_batch_size, seq_len]; ``Stateful``.

    - ``state_dict()``: this DP rank's position (picklable dict, a few hundred bytes).
    - ``load_state_dict(state)``: continue exactly (same DP world size; the worker count may differ).
    - ``load_resharded(states)``: the states of *all* old DP ranks when the DP world size changed:
      the unread units and unemitted tokens of all old ranks are re-dealt to the new ranks,
      none repeated, none skipped (docs/datasets.md, "Resume and reshard").
    - ``read_stats()``: what this rank has read so far (shards opened, bytes of those files).
    Call the load methods before iterating; each ``iter()`` continues from the current state.
    """

    def __init__(self, source: DocumentSource, tokenizer, *, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_world_size: int, num_workers: int = 0, infinite: bool = True,
                 pin_memory: bool = False, prefetch_factor: int | None = None) -> None:
        self.source = source
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.num_workers = num_workers
        self.infinite = infinite
        k = self._num_streams
        self.num_shards = source.num_shards
        self.layout = choose_layout(self.num_shards, dp_world_size * k)
        units = self.num_shards if self.layout == "shards" else source.num_docs
        self._states = [new_stream_state(dp_rank + dp_world_size * i, dp_world_size * k, units)
                        for i in range(k)]
        self._last = -1  # index into _states of the stream that yielded last
        self._opened: list[int] = []
        if dp_rank == 0:
            self._log_layout()

    def _log_layout(self) -> None:
        w, k, s = self.dp_world_size, self._num_streams, self.num_shards
        streams = f"{w} dp rank(s) x {k} stream(s) = {w * k} streams"
        if self.layout == "shards":
            per_rank = f"{s // w}" if s % w == 0 else f"{s // w}-{s // w + 1}"
            logger.info(f"dataset {self.source.name!r}: {s} shards over {streams}: whole shards, each rank "
                        f"reads {per_rank} of {s} shards per epoch")
        else:
            why = "one shard" if s == 1 else f"fewer shards ({s}) than streams"
            logger.info(f"dataset {self.source.name!r}: {why} over {streams}: documents are dealt, every "
                        "stream parses the whole stream and tokenizes its own documents")

    @property
    def _num_streams(self) -> int:
        return max(1, self.num_workers)

    def _ordered(self) -> list[dict]:
        i = self._last + 1
        return self._states[i:] + self._states[:i]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._states, self._last = self._ordered(), -1
        dataset = self._dataset(copy.deepcopy(self._states))
        with warnings.catch_warnings():  # torchdata calls the deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            loader = StatefulDataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                        collate_fn=_passthrough, in_order=True, pin_memory=self.pin_memory,
                                        prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None)
        for inputs, labels, k, state, opened in loader:
            if isinstance(inputs, str):  # a TitanError raised in a worker
                raise TitanError(labels)
            self._opened.extend(opened)
            self._states[k], self._last = state, k
            if inputs is not None:
                yield inputs, labels

    def _dataset(self, states: list[dict]) -> IterableDataset:
        return PackedDataset(self.source, self.tokenizer, states, layout=self.layout, seq_len=self.seq_len,
                             batch_size=self.local_batch_size, infinite=self.infinite, dp_rank=self.dp_rank)

    def scalars(self) -> dict[str, float]:
        """Extra metrics of the data (a mixture's tokens per source); none for one source."""
        return {}

    def read_stats(self) -> dict:
        """Shards this rank started reading (each time) and the on-disk bytes of those files; a pass
        over the whole stream (documents layout) counts every file. Bytes are None when the files
        are not local (hub streaming)."""
        sizes = [self.source.shard_bytes(j) for j in range(self.num_shards)]
        known = None not in sizes
        read = sum(sum(sizes) if j < 0 else sizes[j] for j in self._opened) if known else None
        return {"opened": list(self._opened), "bytes_read": read, "bytes_total": sum(sizes) if known else None}

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "dataset": self.source.name,
            "layout": self.layout,
            "num_shards": self.num_shards,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "num_workers": self.num_workers,
            "streams": copy.deepcopy(self._ordered()),
        }

    def _check(self, state: dict) -> dict | None:
        """A saved state in the current format; None when it belongs to another dataset (then
        start fresh). A state dealt another way (shards vs documents) cannot be continued."""
        if isinstance(state, dict) and state.get("kind") == "mixture":
            logger.warning(f"checkpoint's data loader state is a mixture's, this run reads {self.source.name!r}: "
                           f"starting {self.source.name!r} from its beginning")
            return None
        if isinstance(state, dict) and state.get("version") == 1:
            state = _upgrade_v1(state)
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise TitanError(f"data loader state has an unknown format (expected version {STATE_VERSION})")
        if state["dataset"] != self.source.name:
            logger.warning(f"checkpoint's data loader state is for dataset {state['dataset']!r}, this run "
                           f"reads {self.source.name!r}: starting {self.source.name!r} from its beginning")
            return None
        if state["layout"] != self.layout or (self.layout == "shards" and state.get("num_shards") != self.num_shards):
            raise TitanError(
                f"data loader state for {self.source.name!r} was saved dealing {state['layout']} "
                f"({state.get('num_shards')} shards, {state['dp_world_size']} dp ranks x "
                f"{max(1, state['num_workers'])} workers); this run deals {self.layout} ({self.num_shards} shards, "
                f"{self.dp_world_size} x {self._num_streams}) and cannot continue it exactly: keep dp ranks x "
                f"workers on the same side of the shard count, or add 'dataloader' to "
                "checkpoint.exclude_from_loading to start the data from its beginning"
            )
        return state

    def _log_resume(self) -> None:
        parts = []
        for st in self._states:
            first = st["cur"] if st["cur"] is not None else (st["pending"][0] if st["pending"] else None)
            if self.layout == "shards" and first is not None and first[1] > 0:
                parts.append(f"stream {st['slot']} reopens {self.source.shard_name(first[0] % self.num_shards)} "
                             f"at row {first[1]}")
            elif self.layout == "documents" and not self.source.seekable:
                parts.append(f"stream {st['slot']} re-reads the stream up to position {next_position(st)}")
        rows = {tuple(seg[:2]) for st in self._states for seg in st["segments"]}
        parts.append(f"{len(rows)} buffered document(s) re-read and re-tokenized")
        logger.info(f"data loader resume (dp rank {self.dp_rank}): " + "; ".join(parts))

    def load_state_dict(self, state: dict) -> None:
        state = self._check(state)
        if state is None:
            return
        if state["dp_world_size"] != self.dp_world_size or state["dp_rank"] != self.dp_rank:
            raise TitanError(
                f"data loader state is from dp rank {state['dp_rank']} of {state['dp_world_size']}, this is "
                f"rank {self.dp_rank} of {self.dp_world_size}: use load_resharded with all old ranks' states"
            )
        streams = copy.deepcopy(state["streams"])
        if len(streams) != self._num_streams:
            # only the worker count changed: re-deal this rank's own units among its new streams
            k, w = self._num_streams, self.dp_world_size
            logger.info(f"data loader: {len(streams)} stream(s) saved, {k} now: re-dealing dp rank "
                        f"{self.dp_rank}'s unread units")
            streams = reshard_states(streams, [self.dp_rank + w * i for i in range(k)], w * k)
        self._states, self._last = streams, -1
        self._log_resume()

    def load_resharded(self, states: list[dict]) -> None:
        """Restore from the states of all old DP ranks (any old world size and worker count).

        Global cursor M = the furthest position any old stream reached. Every unit an old stream
        still owned below M (a partly read shard from its row on), and every old rank's partly
        packed buffer, is re-dealt deterministically to the new streams; from M on, positions are
        dealt p % (W'*K') as in a fresh run. Same old and new world size: ``load_state_dict``.
        """
        states = [c for c in (self._check(s) for s in states) if c is not None]
        if not states:
            return
        old_w = {s["dp_world_size"] for s in states}
        if len(old_w) != 1:
            raise TitanError(f"load_resharded: states from different dp world sizes {sorted(old_w)}")
        (w_old,) = old_w
        ranks = sorted(s["dp_rank"] for s in states)
        if ranks != list(range(w_old)):
            raise TitanError(f"load_resharded needs the states of all {w_old} old dp ranks, got ranks {ranks}")
        if w_old == self.dp_world_size:
            self.load_state_dict(states[ranks.index(self.dp_rank)])
            return
        old_streams = [st for s in states for st in s["streams"]]
        strides = {st["stride"] for st in old_streams}
        slots = sorted(st["slot"] for st in old_streams)
        if len(strides) != 1 or slots != list(range(len(old_streams))) or strides != {len(old_streams)}:
            raise TitanError("load_resharded: the old data loader states do not form one complete layout")
        w, k = self.dp_world_size, self._num_streams
        new = reshard_states(old_streams, list(range(w * k)), w * k)
        self._states, self._last = [new[self.dp_rank + w * i] for i in range(k)], -1
        logger.info(f"data loader resharded from {w_old} to {w} dp ranks")
        self._log_resume()


def build_dataloader(*, dataset: str, dataset_path: str, text_field: str, tokenizer, seq_len: int,
                     local_batch_size: int, dp_rank: int, dp_world_size: int, num_workers: int = 0,
                     infinite: bool = True, txt_split: str = "paragraph",
                     bad_lines: str = "fail", pin_memory: bool = False,
                     prefetch_factor: int | None = None) -> TitanDataLoader:
    """Build the loader for one DP rank (see TitanDataLoader). ``txt_split``: how .txt files are cut
    into documents (paragraph, line, document)."""
    if seq_len < 1 or local_batch_size < 1:
        raise TitanError(f"training.seq_len ({seq_len}) and training.local_batch_size ({local_batch_size}) must be >= 1")
    if not 0 <= dp_rank < dp_world_size:
        raise TitanError(f"dp_rank {dp_rank} is outside the dp world size {dp_world_size}")
    if num_workers < 0:
        raise TitanError(f"training.dataloader_num_workers ({num_workers}) must be >= 0")
    source = build_source(dataset, dataset_path, text_field, txt_split, bad_lines)
    return TitanDataLoader(source, tokenizer, seq_len=seq_len, local_batch_size=local_batch_size,
                           dp_rank=dp_rank, dp_world_size=dp_world_size, num_workers=num_workers,
                           infinite=infinite, pin_memory=pin_memory, prefetch_factor=prefetch_factor)
