"""Reading a token store: windows of seq_len + 1 tokens straight from the memory maps.

A store of T tokens has N = T // (seq_len + 1) windows per epoch; window i is tokens
``i * (seq_len + 1) ...`` of the concatenated shards, so the windows are the online loader's
packed windows for the same documents (documents as ``BOS + tokens + EOS``, one stream). The
loader's streams, slots, strides, pending entries and resharding (titan/data/packing.py) apply
unchanged with one *unit* per window: position p is window p mod N of epoch p // N, and a
resume costs one binary search over the shard starts, wherever the run stopped.

Shuffling (``shuffle_seed``) visits the windows of each epoch in the order of a keyed Feistel
permutation of 0..N-1 (cycle-walked to N), keyed by seed and epoch: O(1) memory and time per
window, the same order on every run and after every resume.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset

from titan.errors import TitanError
from titan.log import logger

from .loader import PackedDataset, TitanDataLoader
from .packing import PackedBatch
from .state import LoaderState, StreamState
from .token_store import TokenStore

__all__ = ["StoreDataLoader", "permute"]

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit hash of x."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def permute(i: int, n: int, seed: int, epoch: int) -> int:
    """The image of i under a bijection of 0..n-1 chosen by (seed, epoch)."""
    if n <= 2:
        return i if n < 2 or _mix64(seed * 1000003 + epoch) & 1 == 0 else 1 - i
    bits = (n - 1).bit_length()
    bits += bits & 1
    half = bits // 2
    mask = (1 << half) - 1
    key = _mix64((seed & _M64) ^ _mix64(epoch + 0x9E3779B97F4A7C15))
    x = i
    while True:  # cycle walking: at most 4n values in the domain, so a few rounds on average
        left, right = x >> half, x & mask
        for r in range(4):
            left, right = right, left ^ (_mix64(right ^ key ^ (r << 56)) & mask)
        x = (left << half) | right
        if x < n:
            return x


def window_stream(
    store: TokenStore,
    state: StreamState,
    *,
    seq_len: int,
    batch_size: int,
    infinite: bool,
    shuffle_seed: int | None,
    label: str = "",
) -> Iterator[PackedBatch]:
    """Like pack_stream, for a store: windows [batch_size, seq_len + 1], the state after them, no
    units opened. Finite mode ends before the first position of epoch 1 with an item without
    windows; a batch the epoch cannot fill is not emitted and its windows stay unread in the state."""
    state = state.clone()
    n, span = state.num_units, seq_len + 1
    assert n is not None, "a token store's stream knows its window count"
    while True:
        before = None if infinite else state.clone()
        rows = np.empty((batch_size, span), dtype=np.int64)
        for b in range(batch_size):
            if before is not None and state.next_position() >= n:
                yield PackedBatch(None, before, [])
                return
            epoch, i = divmod(state.take_unit().position, n)
            if epoch > state.epoch:  # the loader's main process says so (epochs.py)
                state.epoch = epoch
            if shuffle_seed is not None:
                i = permute(i, n, shuffle_seed, epoch)
            rows[b] = store.read(i * span, span)
        state.docs += batch_size
        yield PackedBatch(torch.from_numpy(rows), state.clone(), [])


class WindowDataset(PackedDataset):
    """PackedDataset over a token store's windows (one stream per worker)."""

    def __init__(
        self,
        store: TokenStore,
        states: list[StreamState],
        *,
        seq_len: int,
        batch_size: int,
        infinite: bool,
        shuffle_seed: int | None,
        dp_rank: int = 0,
    ) -> None:
        super().__init__(
            store,
            None,
            states,
            layout="windows",
            seq_len=seq_len,
            batch_size=batch_size,
            infinite=infinite,
            dp_rank=dp_rank,
        )
        self.store, self.shuffle_seed = store, shuffle_seed

    def _stream(self, state: StreamState, label: str) -> Iterator[PackedBatch]:
        return window_stream(
            self.store,
            state,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            infinite=self.infinite,
            shuffle_seed=self.shuffle_seed,
            label=label,
        )


class StoreDataLoader(TitanDataLoader):
    """TitanDataLoader over a token store: the same streams, state, exact resume and resharding,
    with windows as units (no tokenizer at train time; the run's tokenizer must be the store's)."""

    def __init__(
        self,
        store: TokenStore,
        tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        num_workers: int = 0,
        infinite: bool = True,
        shuffle_seed: int | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
    ) -> None:
        if tokenizer is not None:
            store.check_tokenizer(tokenizer)
        n = store.num_windows(seq_len)
        if n < 1:
            raise TitanError(
                f"token store {store.path!r} holds {store.num_tokens} tokens, fewer than one window of "
                f"training.seq_len + 1 = {seq_len + 1}"
            )
        self.source, self.tokenizer = store, tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.num_workers, self.infinite, self.shuffle_seed = num_workers, infinite, shuffle_seed
        self.pin_memory, self.prefetch_factor = pin_memory, prefetch_factor
        self.layout, self.num_shards, self.num_windows = "windows", len(store.shards), n
        self._states = self._fresh_states(n)
        self._last = -1
        self._opened: list[int] = []
        if dp_rank == 0:
            order = "in order" if shuffle_seed is None else f"shuffled (seed {shuffle_seed})"
            logger.info(
                f"token store {store.path!r}: {store.num_tokens:,} tokens in {self.num_shards} shard(s), "
                f"{n:,} windows of {seq_len + 1} per epoch, read {order} by {dp_world_size} dp rank(s) x "
                f"{self._num_streams} stream(s)"
            )

    def _dataset(self, states: list[StreamState]) -> IterableDataset:
        return WindowDataset(
            self.source,
            states,
            seq_len=self.seq_len,
            batch_size=self.local_batch_size,
            infinite=self.infinite,
            shuffle_seed=self.shuffle_seed,
            dp_rank=self.dp_rank,
        )

    def read_stats(self) -> dict:
        """Bytes of the windows read (the store is read window by window, not by whole files)."""
        windows = sum(st.docs for st in self._states)
        return {
            "opened": [],
            "bytes_read": windows * (self.seq_len + 1) * self.source.dtype.itemsize,
            "bytes_total": self.source.num_tokens * self.source.dtype.itemsize,
        }

    def _state(self) -> LoaderState:
        state = super()._state()
        state.num_windows, state.shuffle_seed = self.num_windows, self.shuffle_seed
        return state

    def _check(self, state: dict) -> LoaderState | None:
        saved = super()._check(state)
        if saved is None:
            return None
        if (saved.num_windows, saved.shuffle_seed) != (self.num_windows, self.shuffle_seed):
            raise TitanError(
                f"data loader state for token store {self.source.path!r} was saved with {saved.num_windows} "
                f"windows per epoch and shuffle seed {saved.shuffle_seed}, this run has {self.num_windows} "
                f"and {self.shuffle_seed} (training.seq_len or training.dataset_shuffle_seed changed); keep them, "
                "or add 'dataloader' to checkpoint.exclude_from_loading to start the data from its beginning"
            )
        return saved

    def _log_resume(self) -> None:
        at = ", ".join(f"stream {st.slot} at window position {st.next_position():,}" for st in self._states)
        logger.info(f"data loader resume (dp rank {self.dp_rank}): {at} (a direct seek, nothing re-read)")
