"""The stateful, DP-aware data loader.

Layout: DP rank r with K = max(1, num_workers) loader workers runs K *streams*, slots r + W*k
(W = DP world size), stride W*K (see titan/data/packing.py for what a stream owns). A source with
at least W*K shards is dealt by whole shards (each rank reads ~1/W of the files); otherwise by
documents (every stream parses the whole stream). Worker k runs one stream and yields whole
batches (``StreamBatch``, titan/data/state.py); ``StatefulDataLoader`` hands them out round-robin
(in order), so the rank's batch sequence is the interleaving stream 0, 1, ..., K-1, 0, 1, ...

Exact state with workers: every batch travels with its stream's state *after* that batch; the
loader records it only when the batch is handed to the caller, so prefetched batches never leak
into a checkpoint. ``state_dict()`` lists the K stream states starting with the one whose batch
comes next; on restore worker k runs the k-th of them, so a fresh loader continues exactly where
the old one stopped. (The stream's identity lives in its state, not in the worker id.)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titan.errors import TitanError
from titan.log import logger

from .datasets import build_source
from .epochs import EpochLog
from .packing import PackedBatch, choose_layout, pack_stream, reshard_states
from .sources import DocumentSource
from .state import (
    LoaderState,
    SavedRankStates,
    StreamBatch,
    StreamState,
    WorkerError,
    is_mixture_state,
    restore_rank_states,
)

__all__ = ["PackedDataset", "TitanDataLoader", "build_dataloader"]


def _passthrough(item):
    return item


class PackedDataset(IterableDataset):
    """Stateful IterableDataset: one stream per worker; yields a ``StreamBatch`` per batch, or a
    ``WorkerError`` when the stream raised a TitanError in a worker process."""

    def __init__(
        self,
        source: Any,
        tokenizer,
        states: list[StreamState],
        *,
        layout: str,
        seq_len: int,
        batch_size: int,
        infinite: bool,
        dp_rank: int = 0,
    ) -> None:
        self.source = source
        self.layout = layout
        self.tokenizer = tokenizer
        self.states = states
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.infinite = infinite
        self.dp_rank = dp_rank
        self._live: StreamState | None = None

    def __iter__(self) -> Iterator[StreamBatch | WorkerError]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if num_workers != len(self.states):
            raise RuntimeError(f"PackedDataset has {len(self.states)} stream states for {num_workers} workers")
        self._live = self.states[worker]
        stream = self._stream(self._live, f" (dp rank {self.dp_rank}, stream {self._live.slot})")
        try:
            for windows, state, opened in stream:
                self._live = state
                if windows is None:
                    yield StreamBatch(None, None, worker, state, opened)
                else:
                    yield StreamBatch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous(), worker, state, opened)
        except TitanError as e:
            if info is None:
                raise
            yield WorkerError(str(e), worker)

    def _stream(self, state: StreamState, label: str) -> Iterator[PackedBatch]:
        return pack_stream(
            self.source,
            self.tokenizer,
            state,
            layout=self.layout,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            infinite=self.infinite,
            label=label,
        )

    def state_dict(self) -> dict:
        return {"stream": (self._live if self._live is not None else self.states[0]).to_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.states = [StreamState.from_dict(state["stream"])]


class TitanDataLoader:
    """Yields ``(input_ids, labels)``, LongTensors [local_batch_size, seq_len]; ``Stateful``.

    - ``state_dict()``: this DP rank's position (plain Python, a few hundred bytes).
    - ``load_state_dict(state)``: continue exactly (same DP world size; the worker count may differ).
    - ``load_resharded(states)``: the states of *all* old DP ranks when the DP world size changed:
      the unread units and unemitted tokens of all old ranks are re-dealt to the new ranks,
      none repeated, none skipped (docs/datasets.md, "Resume and reshard").
    - ``load_rank_states(saved)``: a checkpoint's per-rank states; picks one of the two above.
    - ``read_stats()``: what this rank has read so far (shards opened, bytes of those files).
    Call the load methods before iterating; each ``iter()`` continues from the current state.
    """

    run_batches: int | None = None  # this rank's batches in the run, when known (set by the trainer; epochs.py)

    def __init__(
        self,
        source: DocumentSource,
        tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        num_workers: int = 0,
        infinite: bool = True,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
    ) -> None:
        assert 0 <= dp_rank < dp_world_size, f"dp rank {dp_rank} outside dp world size {dp_world_size}"
        self.source: Any = source
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.num_workers = num_workers
        self.infinite = infinite
        self.num_shards = source.num_shards
        self.layout = choose_layout(self.num_shards, dp_world_size * self._num_streams)
        units = self.num_shards if self.layout == "shards" else source.num_docs
        self._states = self._fresh_states(units)
        self._last = -1  # index into _states of the stream that yielded last
        self._opened: list[int] = []
        if dp_rank == 0:
            self._log_layout()

    def _fresh_states(self, num_units: int | None) -> list[StreamState]:
        streams, world = self._num_streams, self.dp_world_size
        return [StreamState.new(self.dp_rank + world * i, world * streams, num_units) for i in range(streams)]

    def _log_layout(self) -> None:
        world, streams, shards = self.dp_world_size, self._num_streams, self.num_shards
        layout = f"{world} dp rank(s) x {streams} stream(s) = {world * streams} streams"
        if self.layout == "shards":
            low = shards // world
            per_rank = f"{low}" if shards % world == 0 else f"{low}-{low + 1}"
            logger.info(
                f"dataset {self.source.name!r}: {shards} shards over {layout}: whole shards, each rank "
                f"reads {per_rank} of {shards} shards per epoch"
            )
        else:
            why = "one shard" if shards == 1 else f"fewer shards ({shards}) than streams"
            logger.info(
                f"dataset {self.source.name!r}: {why} over {layout}: documents are dealt, every "
                "stream parses the whole stream and tokenizes its own documents"
            )

    @property
    def _num_streams(self) -> int:
        return max(1, self.num_workers)

    def _ordered(self) -> list[StreamState]:
        i = self._last + 1
        return self._states[i:] + self._states[:i]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._states, self._last = self._ordered(), -1
        what = f"token store {self.source.path!r}" if self.layout == "windows" else f"dataset {self.source.name!r}"
        epochs = EpochLog(what, self.dp_rank, self.run_batches if self.infinite else None)
        epochs.start(self._states)
        dataset = self._dataset([st.clone() for st in self._states])
        with warnings.catch_warnings():  # torchdata calls the deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            loader = StatefulDataLoader(
                dataset,
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=_passthrough,
                in_order=True,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            )
        for item in loader:
            if isinstance(item, WorkerError):
                raise TitanError(item.message)
            self._opened.extend(item.opened)
            self._states[item.worker], self._last = item.state, item.worker
            epochs.batch(item.worker, item.state)
            if item.inputs is not None and item.labels is not None:
                yield item.inputs, item.labels

    def _dataset(self, states: list[StreamState]) -> IterableDataset:
        return PackedDataset(
            self.source,
            self.tokenizer,
            states,
            layout=self.layout,
            seq_len=self.seq_len,
            batch_size=self.local_batch_size,
            infinite=self.infinite,
            dp_rank=self.dp_rank,
        )

    def scalars(self) -> dict[str, float]:
        """Extra metrics of the data (a mixture's tokens per source); none for one source."""
        return {}

    def read_stats(self) -> dict:
        """Shards this rank started reading (each time) and the on-disk bytes of those files; a pass
        over the whole stream (documents layout) counts every file. Bytes are None when the files
        are not local (hub streaming)."""
        sizes = [self.source.shard_bytes(j) for j in range(self.num_shards)]
        known = [size for size in sizes if size is not None]
        if len(known) < len(sizes):
            return {"opened": list(self._opened), "bytes_read": None, "bytes_total": None}
        read = sum(sum(known) if j < 0 else known[j] for j in self._opened)
        return {"opened": list(self._opened), "bytes_read": read, "bytes_total": sum(known)}

    def _state(self) -> LoaderState:
        return LoaderState(
            dataset=self.source.name,
            layout=self.layout,
            num_shards=self.num_shards,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            num_workers=self.num_workers,
            streams=[st.clone() for st in self._ordered()],
        )

    def state_dict(self) -> dict:
        return self._state().to_dict()

    def _check(self, state: Any) -> LoaderState | None:
        """A saved state, read; None when it belongs to another dataset (then start fresh). A state
        dealt another way (shards vs documents) cannot be continued."""
        if is_mixture_state(state):
            logger.warning(
                f"checkpoint's data loader state is a mixture's, this run reads {self.source.name!r}: "
                f"starting {self.source.name!r} from its beginning"
            )
            return None
        saved = LoaderState.from_dict(state)
        if saved.dataset != self.source.name:
            logger.warning(
                f"checkpoint's data loader state is for dataset {saved.dataset!r}, this run "
                f"reads {self.source.name!r}: starting {self.source.name!r} from its beginning"
            )
            return None
        if saved.layout != self.layout or (self.layout == "shards" and saved.num_shards != self.num_shards):
            raise TitanError(
                f"data loader state for {self.source.name!r} was saved dealing {saved.layout} "
                f"({saved.num_shards} shards, {saved.dp_world_size} dp ranks x "
                f"{max(1, saved.num_workers)} workers); this run deals {self.layout} ({self.num_shards} shards, "
                f"{self.dp_world_size} x {self._num_streams}) and cannot continue it exactly: keep dp ranks x "
                f"workers on the same side of the shard count, or add 'dataloader' to "
                "checkpoint.exclude_from_loading to start the data from its beginning"
            )
        return saved

    def _log_resume(self) -> None:
        parts = []
        for st in self._states:
            first = st.cur if st.cur is not None else (st.pending[0] if st.pending else None)
            if self.layout == "shards" and first is not None and first.row > 0:
                parts.append(
                    f"stream {st.slot} reopens {self.source.shard_name(first.position % self.num_shards)} "
                    f"at row {first.row}"
                )
            elif self.layout == "documents" and not self.source.seekable:
                parts.append(f"stream {st.slot} re-reads the stream up to position {st.next_position()}")
        rows = {(seg.position, seg.row) for st in self._states for seg in st.segments}
        parts.append(f"{len(rows)} buffered document(s) re-read and re-tokenized")
        logger.info(f"data loader resume (dp rank {self.dp_rank}): " + "; ".join(parts))

    def load_state_dict(self, state_dict: dict) -> None:
        saved = self._check(state_dict)
        if saved is not None:
            self._restore(saved)

    def _restore(self, saved: LoaderState) -> None:
        if saved.dp_world_size != self.dp_world_size or saved.dp_rank != self.dp_rank:
            raise TitanError(
                f"data loader state is from dp rank {saved.dp_rank} of {saved.dp_world_size}, this is "
                f"rank {self.dp_rank} of {self.dp_world_size}: use load_resharded with all old ranks' states"
            )
        streams = saved.streams
        if len(streams) != self._num_streams:
            # only the worker count changed: re-deal this rank's own units among its new streams
            count, world = self._num_streams, self.dp_world_size
            logger.info(
                f"data loader: {len(streams)} stream(s) saved, {count} now: re-dealing dp rank "
                f"{self.dp_rank}'s unread units"
            )
            streams = reshard_states(streams, [self.dp_rank + world * i for i in range(count)], world * count)
        self._states, self._last = streams, -1
        self._log_resume()

    def load_resharded(self, states: list[dict]) -> None:
        """Restore from the states of all old DP ranks (any old world size and worker count).

        Global cursor M = the furthest position any old stream reached. Every unit an old stream
        still owned below M (a partly read shard from its row on), and every old rank's partly
        packed buffer, is re-dealt deterministically to the new streams; from M on, positions are
        dealt p % (W'*K') as in a fresh run. Same old and new world size: ``load_state_dict``.
        """
        checked = [c for c in (self._check(s) for s in states) if c is not None]
        if not checked:
            return
        old_worlds = {s.dp_world_size for s in checked}
        if len(old_worlds) != 1:
            raise TitanError(f"load_resharded: states from different dp world sizes {sorted(old_worlds)}")
        (old_world,) = old_worlds
        ranks = sorted(s.dp_rank for s in checked)
        if ranks != list(range(old_world)):
            raise TitanError(f"load_resharded needs the states of all {old_world} old dp ranks, got ranks {ranks}")
        if old_world == self.dp_world_size:
            self._restore(next(c for c in checked if c.dp_rank == self.dp_rank))
            return
        old_streams = [st for s in checked for st in s.streams]
        strides = {st.stride for st in old_streams}
        slots = sorted(st.slot for st in old_streams)
        if len(strides) != 1 or slots != list(range(len(old_streams))) or strides != {len(old_streams)}:
            raise TitanError("load_resharded: the old data loader states do not form one complete layout")
        world, count = self.dp_world_size, self._num_streams
        new = reshard_states(old_streams, list(range(world * count)), world * count)
        self._states, self._last = [new[self.dp_rank + world * i] for i in range(count)], -1
        logger.info(f"data loader resharded from {old_world} to {world} dp ranks")
        self._log_resume()

    def load_rank_states(self, saved: SavedRankStates) -> None:
        """Resume from a checkpoint's per-rank loader states (see restore_rank_states)."""
        restore_rank_states(self, saved)


def build_dataloader(
    *,
    dataset: str,
    dataset_path: str,
    text_field: str,
    tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    num_workers: int = 0,
    infinite: bool = True,
    txt_split: str = "paragraph",
    bad_lines: str = "fail",
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    config: str = "",
    split: str = "",
    section: str = "training",
) -> TitanDataLoader:
    """Build the loader for one DP rank (see TitanDataLoader). ``txt_split``: how .txt files are cut
    into documents (paragraph, line, document); ``config`` / ``split``: a hub dataset's (see
    build_source; ``section`` names the keys in errors). The sizes are the config's, checked there."""
    source = build_source(
        dataset, dataset_path, text_field, txt_split, bad_lines, config=config, split=split, section=section
    )
    return TitanDataLoader(
        source,
        tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        num_workers=num_workers,
        infinite=infinite,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
    )
