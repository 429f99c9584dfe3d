"""NCCL process groups through titan's own init / teardown (titan/parallel/utils.py)."""

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.cuda


def _init_reduce_destroy(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from titan.parallel.utils import destroy_distributed, init_distributed, pick_device

    device = pick_device(rank)
    # A 1-process job skips the process group in titan (nothing to talk to), so init it here the
    # way a launcher-started rank does: titan's backend string, env:// rendezvous.
    if world == 1:
        dist.init_process_group(backend="cuda:nccl,cpu:gloo", device_id=device)
    else:
        init_distributed(device, world, timeout_s=120)
    backend = dist.get_backend()
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    host = torch.ones(2) * (rank + 1)  # the gloo half of the backend, for CPU tensors
    dist.all_reduce(host)
    dist.barrier()
    destroy_distributed()
    return {
        "device": str(device),
        "backend": backend,
        "sum": x.tolist(),
        "host_sum": host.tolist(),
        "initialized_after": dist.is_initialized(),
    }


def test_one_process_nccl_group_init_all_reduce_destroy():
    [r] = run_distributed(_init_reduce_destroy, 1, backend="nccl", init_group=False, timeout=300)
    assert r == {
        "device": "cuda:0",
        "backend": r["backend"],
        "sum": [1.0] * 4,
        "host_sum": [1.0] * 2,
        "initialized_after": False,
    }
    assert "nccl" in r["backend"]


def test_two_rank_nccl_all_reduce():
    """Skips (with the reason) on a machine with fewer than 2 GPUs."""
    results = run_distributed(_init_reduce_destroy, 2, backend="nccl", init_group=False, timeout=300)
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]
    assert all(r["sum"] == [3.0] * 4 and r["host_sum"] == [3.0] * 2 for r in results)
    assert not any(r["initialized_after"] for r in results)
    assert torch.cuda.is_available()
