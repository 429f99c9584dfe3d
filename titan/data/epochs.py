"""Epoch boundaries of an endless training stream, said as plainly as they are.

An endless stream that reaches the end of its data starts it again (epoch 1, 2, ...). That is
expected when a run is meant to go over its data more than once (the embedded demo corpus does,
about 1.2 times), so a boundary is an INFO line. It is a WARNING when the data ends far earlier
than the run needs: the first pass ended before 1/FAR_PASSES of the run's batches, i.e. the run
reads every document more than FAR_PASSES times over, which usually means a wrong or truncated
dataset_path, or steps meant for a larger dataset.

The loader's main process sees every batch with its stream's state (titan/data/loader.py), so the
lines come from there, once per boundary and stream, not from worker processes. The length of a
pass is measured in the stream's own units (documents, or a token store's windows) per batch
since this process started reading, so a run resumed in the middle of a pass judges it the same.
"""

from __future__ import annotations

from titan.log import logger

from .state import StreamState

__all__ = ["FAR_PASSES", "EpochLog"]

FAR_PASSES = 4


class EpochLog:
    """One per iteration of a loader (``what``: "dataset 'c4'", "token store '/data/x'"): ``start``
    with the streams' states, then ``batch`` for
    every batch a stream yields. ``run_batches``: this rank's batches in the whole run (None:
    unknown, e.g. a validation set; then every boundary is an INFO line)."""

    def __init__(self, what: str, dp_rank: int, run_batches: int | None) -> None:
        self.what, self.dp_rank, self.run_batches = what, dp_rank, run_batches
        self.warned = False
        self._epoch: dict[int, int] = {}
        self._docs0: dict[int, int] = {}
        self._batches: dict[int, int] = {}

    def start(self, states: list[StreamState]) -> None:
        for worker, state in enumerate(states):
            self._epoch[worker], self._docs0[worker], self._batches[worker] = state.epoch, state.docs, 0

    def batch(self, worker: int, state: StreamState) -> None:
        self._batches[worker] += 1
        if state.epoch <= self._epoch[worker]:
            return
        self._epoch[worker] = state.epoch
        per_batch = (state.docs - self._docs0[worker]) / self._batches[worker]
        pass_batches = state.docs / state.epoch / per_batch if per_batch > 0 else 0.0
        where = f"{self.what} (dp rank {self.dp_rank}, stream {state.slot})"
        streams = len(self._epoch)
        if not self.run_batches or pass_batches <= 0:
            logger.info(f"{where}: read through its data; epoch {state.epoch} begins, reading it again in order")
            return
        passes = self.run_batches / streams / pass_batches
        if passes > FAR_PASSES and not self.warned:
            self.warned = True
            logger.warning(
                f"{where}: its data ended after about {pass_batches:,.0f} of the run's"
                f" {self.run_batches / streams:,.0f} batches: this run reads it about {passes:,.0f} times over"
                f" (more than {FAR_PASSES}); point training.dataset_path at more data or lower training.steps,"
                " unless that many passes are intended"
            )
            return
        logger.info(
            f"{where}: read through its data; epoch {state.epoch} begins, reading it again in order"
            f" (this run: about {passes:.1f} passes)"
        )
