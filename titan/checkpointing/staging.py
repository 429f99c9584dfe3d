"""The reusable stager of ``async_with_pinned_mem``.

DCP's ``DefaultStager`` keeps the host copies of the last save (pinned on a GPU machine) and
copies into them again on the next save, which is the point of the mode. Some torch releases
close a stager passed to ``dcp.async_save`` once that save's upload is done; a closed stager's
copier has an empty dispatch table, so the *next* save dies deep inside it with
``KeyError(<class 'type'>)`` (measured: that is the exact ``<class 'type'>`` a CUDA run with
torch 2.11 printed on every second save). ``OwnedStager`` hands DCP a proxy whose ``close`` does
nothing, so only the checkpoint manager ends the stager's life, and rebuilds it should anything
else have closed it.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from titan.log import logger


def staging_options() -> StagingOptions:
    """Pinned memory and non-blocking copies need an accelerator (CPU-only torch refuses
    non-blocking copies: measured); the background copy works everywhere."""
    accel = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=accel, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=accel
    )


class OwnedStager(AsyncStager):
    _synchronize_after_execute = False  # the trainer waits on the staging future itself

    def __init__(self) -> None:
        if not torch.accelerator.is_available():
            logger.info(
                "checkpoint.async_mode=async_with_pinned_mem: no accelerator, so staging uses plain "
                "(unpinned) host memory with blocking copies in a background thread"
            )
        self._stager: DefaultStager | None = DefaultStager(staging_options())

    def _live(self) -> DefaultStager:
        inner = self._stager
        if inner is None or not inner._state_dict_stager._deepcopy_dispatch:
            logger.warning("checkpoint staging buffers were released by torch after the last save; allocating new ones")
            self._stager = inner = DefaultStager(staging_options())
        return inner

    def stage(self, state_dict: Any, **kwargs: Any) -> Future | Any:
        return self._live().stage(state_dict, **kwargs)

    def synchronize_staging(self) -> None:
        if self._stager is not None:
            self._stager.synchronize_staging()

    def close(self) -> None:
        """Called by DCP after an upload in some torch releases: the buffers stay for the next save."""

    def shutdown(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
