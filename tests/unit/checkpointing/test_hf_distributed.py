"""HF folders into and out of an FSDP2-sharded model on 2 gloo ranks (initial_load_in_hf / last_save_in_hf hooks)."""

import gc
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny import assert_bitwise, random_model, small_args
from titan.checkpointing.hf import load_hf, save_hf

SHARD_BYTES = 64 * 1024  # the small model (about 0.5 MB) is written as several files


def _storages() -> dict[int, int]:
    """data_ptr -> bytes of every CPU storage a Python tensor object holds now."""
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _fsdp_round_trip(rank: int, world: int, src: str, out: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titan.checkpointing.hf import load_hf_into_model, save_model_hf
    from titan.models.llama.model import Transformer
    from titan.parallel.fsdp import apply_fsdp

    args = small_args()
    with torch.device("meta"):
        model = Transformer(args)
    apply_fsdp(
        model,
        init_device_mesh("cpu", (world,)),
        param_dtype="float32",
        reduce_dtype="float32",
        reshard_after_forward="default",
    )
    model.to_empty(device="cpu")
    load_hf_into_model([model], src)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in model.state_dict().items()}
    import titan.checkpointing.hf as hf

    before = set(_storages())
    held: list[int] = []
    write = hf.save_file

    def measured_write(tensors, path, metadata=None):
        # What the export has gathered and holds while it writes a file: storages new since it began.
        held.append(sum(n for ptr, n in _storages().items() if ptr not in before))
        write(tensors, path, metadata=metadata)

    hf.save_file = measured_write
    try:
        save_model_hf([model], out, max_shard_bytes=SHARD_BYTES)  # args from model.model_args
    finally:
        hf.save_file = write
    model_bytes = sum(v.numel() * v.element_size() for v in full.values())
    largest = max(v.numel() * v.element_size() for v in full.values())
    return sharded, (full, held, model_bytes, largest) if rank == 0 else None


@pytest.mark.slow
def test_fsdp_model_loads_and_exports_hf_bitwise(tmp_path: Path):
    args = small_args()
    sd = random_model(args, seed=5).state_dict()
    save_hf(sd, args, tmp_path / "src")
    results = run_distributed(_fsdp_round_trip, 2, str(tmp_path / "src"), str(tmp_path / "out"))
    assert all(sharded for sharded, _ in results)
    full, held, model_bytes, largest = results[0][1]
    assert_bitwise(full, sd)
    # Rank 0 gathers one file's tensors at a time (a copy of them may exist while they are made
    # contiguous), never the whole model: the bound is well under the model's size.
    bound = 2 * SHARD_BYTES + largest
    assert len(held) > 2 and bound < model_bytes / 2
    assert max(held) <= bound, (held, bound, model_bytes)
    assert_bitwise(load_hf(tmp_path / "out")[0], sd)
