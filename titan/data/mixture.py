"""Weighted mixtures of data sources, each drawn window by window on a fixed schedule.

Every source is a loader of its own (a token store or a text source, with its streams, exact
state and resharding) that yields one window at a time. Window t of a dp rank comes from the
source whose share of [0, 1) holds u_t = frac(t * (sqrt(5) - 1) / 2), computed in 64-bit integer
arithmetic: a low-discrepancy (Kronecker) sequence, so every prefix of the schedule draws each
source in proportion to its weight (within a fraction of a percent after a few thousand windows),
the draw for any t costs O(1) (a resume just continues the counter), and every dp rank draws the
same source at the same t, so the per-source token counts (``data/tokens/NAME``, logged and
checkpointed) are global counts.

A source that runs out either restarts (its loader is endless: it starts its next epoch) or
stops the run (training.mixture_exhausted). A validation mixture instead reads each source
once, one batch per source in turn, and says which source each batch came from (``last_source``)
so the validator can report a loss per source.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterator
from typing import Any

import torch

from titan.errors import TitanError
from titan.log import logger

from .state import MixtureState, SavedRankStates, is_mixture_state, restore_rank_states

__all__ = ["MixtureLoader", "schedule_source"]

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd


def schedule_source(t: int, cumulative: list[float]) -> int:
    """The source of window t for normalized cumulative weights (last entry 1.0)."""
    u = ((t + 1) * _GOLDEN & ((1 << 64) - 1)) / 2.0**64
    return min(bisect.bisect_right(cumulative, u), len(cumulative) - 1)


class MixtureLoader:
    """Yields ``(input_ids, labels)`` batches whose windows come from ``loaders`` by ``weights``.

    ``loaders`` are TitanDataLoader / StoreDataLoader built with local_batch_size 1 (training)
    or the validation batch size (``validation=True``); ``Stateful`` like them.
    """

    def __init__(
        self,
        names: list[str],
        loaders: list,
        weights: list[float],
        *,
        local_batch_size: int,
        seq_len: int,
        dp_rank: int,
        dp_world_size: int,
        exhausted: str = "restart",
        validation: bool = False,
    ) -> None:
        if len(set(names)) != len(names):
            raise TitanError(f"mixture sources must have distinct names, got {names}")
        self.names, self.loaders, self.weights = list(names), list(loaders), [float(w) for w in weights]
        total = sum(self.weights)
        self.cumulative = [sum(self.weights[: i + 1]) / total for i in range(len(self.weights))]
        self.local_batch_size, self.seq_len = local_batch_size, seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.exhausted, self.validation = exhausted, validation
        self.t = 0  # windows this rank has drawn
        self.tokens = [0] * len(names)  # tokens drawn per source, all dp ranks together
        self.last_source = 0
        if dp_rank == 0 and not validation:
            shares = ", ".join(f"{n} {w / total:.1%}" for n, w in zip(self.names, self.weights))
            logger.info(f"data mixture of {len(names)} sources: {shares}; a source that runs out: {exhausted}")

    def source_of(self, t: int) -> int:
        return schedule_source(t, self.cumulative)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._validation_batches() if self.validation else self._training_batches()

    def _training_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # opened on a source's first draw
        iters: list[Iterator[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * len(self.loaders)
        while True:
            inputs, labels = [], []
            for _ in range(self.local_batch_size):
                src = self.source_of(self.t)
                it = iters[src]
                if it is None:
                    it = iters[src] = iter(self.loaders[src])
                window = next(it, None)
                if window is None:
                    logger.warning(
                        f"data mixture: source {self.names[src]!r} ran out after "
                        f"{self.tokens[src]:,} tokens; stopping (training.mixture_exhausted = stop)"
                    )
                    return
                self.t += 1
                self.tokens[src] += window[1].numel() * self.dp_world_size
                inputs.append(window[0])
                labels.append(window[1])
            yield torch.cat(inputs), torch.cat(labels)

    def _validation_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        iters = [iter(loader) for loader in self.loaders]
        live = list(range(len(iters)))
        while live:
            for s in list(live):
                batch = next(iters[s], None)
                if batch is None:
                    live.remove(s)
                    continue
                self.last_source = s
                self.tokens[s] += batch[1].numel() * self.dp_world_size
                yield batch

    def scalars(self) -> dict[str, float]:
        return {f"data/tokens/{name}": float(n) for name, n in zip(self.names, self.tokens)}

    def read_stats(self) -> dict:
        stats = [loader.read_stats() for loader in self.loaders]
        read = [s["bytes_read"] for s in stats]
        total = [s["bytes_total"] for s in stats]
        return {
            "opened": [],
            "bytes_read": None if None in read else sum(read),
            "bytes_total": None if None in total else sum(total),
        }

    def state_dict(self) -> dict:
        return MixtureState(
            names=list(self.names),
            weights=list(self.weights),
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            t=self.t,
            tokens=list(self.tokens),
            sources=[loader.state_dict() for loader in self.loaders],
        ).to_dict()

    def _check(self, state: Any) -> MixtureState | None:
        if not is_mixture_state(state):
            logger.warning("checkpoint's data loader state is not a mixture's: starting the mixture from its beginning")
            return None
        saved = MixtureState.from_dict(state)
        if saved.names != self.names:
            raise TitanError(
                f"checkpoint's data mixture has sources {saved.names}, this run {self.names}; keep the sources "
                "(weights may change), or add 'dataloader' to checkpoint.exclude_from_loading to start afresh"
            )
        if saved.weights != self.weights:
            logger.info(
                f"data mixture weights changed from {saved.weights} to {self.weights}: the schedule "
                f"goes on from window {saved.t} with the new shares"
            )
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        saved = self._check(state_dict)
        if saved is None:
            return
        for loader, source_state in zip(self.loaders, saved.sources):
            loader.load_state_dict(source_state)
        self.t, self.tokens = saved.t, list(saved.tokens)

    def load_resharded(self, states: list[dict]) -> None:
        """All old dp ranks' states: each source reshards on its own; the schedule counter goes on
        from the furthest rank (ranks draw in step, so they agree)."""
        checked = [c for c in (self._check(s) for s in states) if c is not None]
        if not checked:
            return
        for i, loader in enumerate(self.loaders):
            loader.load_resharded([copy.deepcopy(s.sources[i]) for s in checked])
        self.t = max(s.t for s in checked)
        self.tokens = [max(s.tokens[i] for s in checked) for i in range(len(self.names))]

    def load_rank_states(self, saved: SavedRankStates) -> None:
        """Resume from a checkpoint's per-rank loader states (see restore_rank_states)."""
        restore_rank_states(self, saved)
