"""Sharded loads of Hugging Face folders on 2 gloo ranks (one spawned group for every case): each rank
reads only its shard's rows of an FP8 DeepSeek-V3 release (counted in bytes) and holds exactly what a
one-process load holds, in fp32 and in bf16 parameters; tensor-parallel shards (rows of q/k inside
their heads, columns of wo) and a strided shard load exactly too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import hf_release as H
from tests.helpers.distributed import run_distributed
from titan.checkpointing.hf import load_hf


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def _fsdp_load(world: int, src: str, dtype: torch.dtype) -> tuple[int, int, dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh

    from titan.checkpointing.hf import load_hf_into_model, read_hf_config
    from titan.checkpointing.hf_folder import HFFolder
    from titan.models.deepseek_v3.model import DeepSeekV3Transformer
    from titan.parallel.fsdp import apply_fsdp

    with torch.device("meta"):
        model = DeepSeekV3Transformer(read_hf_config(src)).to(dtype)
    name = str(dtype).removeprefix("torch.")
    apply_fsdp(model, init_device_mesh("cpu", (world,)), param_dtype=name, reduce_dtype="float32",
               reshard_after_forward="default")  # fmt: skip
    model.to_empty(device="cpu")
    folder = HFFolder(src)
    load_hf_into_model([model], src, folder)
    return folder.bytes_read, folder.stored_bytes, _full(model)


def _tp_load(world: int, src: str) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from titan.checkpointing.hf import load_hf_into_model, read_hf_config
    from titan.models import spec_for_args

    args = read_hf_config(src)
    spec = spec_for_args(args)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = spec.model_cls(args)
    assert spec.tensor_parallel_fn is not None
    spec.tensor_parallel_fn(model, mesh, loss_parallel=False)
    norm = model.norm.weight  # a strided shard: no box of rows, read whole and cut locally
    model.norm.weight = torch.nn.Parameter(
        distribute_tensor(torch.empty(norm.shape), mesh, [_StridedShard(0, split_factor=2)])
    )
    model.to_empty(device="cpu")
    load_hf_into_model([model], src)
    return _full(model)


def _cases(rank: int, world: int, ds: str, llama: str) -> dict:
    return {
        "fp32": _fsdp_load(world, ds, torch.float32),
        "bf16": _fsdp_load(world, ds, torch.bfloat16),
        "tp": _tp_load(world, llama),
    }


@pytest.mark.slow
def test_each_rank_reads_its_shard_and_loads_what_one_process_loads(tmp_path: Path) -> None:
    H.deepseek_release(tmp_path / "ds")
    H.save_pretrained_folder("llama", tmp_path / "llama")
    results = run_distributed(_cases, 2, str(tmp_path / "ds"), str(tmp_path / "llama"))
    for dtype in (torch.float32, torch.bfloat16):
        expected, _ = load_hf(tmp_path / "ds", dtype=dtype)
        for rank in results:
            read, stored, full = rank["fp32" if dtype == torch.float32 else "bf16"]
            # its half of the model, never the other rank's rows nor the MTP layer (about a third of the folder)
            assert read < 0.4 * stored, (read, stored)
            assert set(full) == set(expected)
            for key, value in expected.items():
                assert torch.equal(full[key], value.to(full[key].dtype)), key
    expected, _ = load_hf(tmp_path / "llama")
    for rank in results:
        for key, value in expected.items():
            assert torch.equal(rank["tp"][key], value), key
