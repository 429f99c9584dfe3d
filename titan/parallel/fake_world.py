"""A fake process group: this process plays one rank of an N-rank world, and nothing is sent.

torch's ``fake`` backend accepts every collective with its real shapes and returns at once. The dry
run, the scale simulator and the memory estimate build a rank's model through titan's own build
functions inside it (meta or fake tensors: nothing is allocated either).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch.distributed as dist

from titan.errors import TitanError

__all__ = ["fake_world", "in_multi_rank_launch"]


def in_multi_rank_launch() -> bool:
    """This process is a rank of a multi-rank launch (torchrun's WORLD_SIZE): no fake world here."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """A fake process group as `rank` of `world_size`, with the torchrun env the Trainer reads."""
    if dist.is_initialized() or in_multi_rank_launch():
        raise TitanError(
            "a fake world (dry run, simulator, memory estimate) must start in a plain process, not under"
            " torchrun (use python train.py / the script directly)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _forget_meshes() -> None:
    """DTensor caches its sharding decisions process-wide, keyed by meshes that compare equal across
    worlds (same ranks and dim names) but name their groups by creation order in each world. After a
    world ends, a later one in this process (another simulation, estimate or dry run) could be
    handed the old mesh and its groups, which no longer exist: the cache goes with the world."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
